"""What the experiments share: their inputs and servers (suite), results folders and machine tags
(common), plots, the swap-under-load driver, and the front-end benchmark's no-op classifier."""
