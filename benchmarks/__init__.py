"""Load generator, experiments and committed results."""
