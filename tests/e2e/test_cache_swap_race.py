"""A version swap while a request's cache lookup waits on Redis (issue 52, item 3).

The HTTP process resolves a request's model version, then looks its image up in the response cache,
which awaits Redis for up to ``--response-cache-redis-timeout-ms``. A load that replaces the version
in that window retires the old version's workers. On the earlier code the request was then sent to a
retired worker, which had already been told nothing more would come, and it hung until its deadline
(504). Now the pipeline checks the route again after the lookup: an unpinned request runs on the
version served now and says so; one that named the retired version gets 404.

Redis is stopped (SIGSTOP) until the load has returned, so the lookups straddle the swap whatever the
machine's speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tritonclient.http as triton_http

from service.client.launcher import ServerProcess
from tests.redis_server import running_redis

pytestmark = pytest.mark.slow  # a compile, a server and a load of 10-20 s each on 2 cores

ADMIN_KEY = "admin-key-for-cache-race-0123"
LOOKUP_TIMEOUT_MS = 120_000  # longer than a load takes here: the lookups end when Redis resumes
REQUEST_TIMEOUT_S = 20  # the earlier code's hang ends here, as a 504


def version_config(version: int) -> str:
    return json.dumps({"version_policy": {"specific": {"versions": [version]}}})


@pytest.fixture(scope="module")
def repository(tmp_path_factory, lite0_eager_artifact):
    root = tmp_path_factory.mktemp("repository")
    for version in (1, 2):
        shutil.copytree(lite0_eager_artifact, root / "lite" / str(version))
    (root / "lite" / "config.toml").write_text("version_policy = {specific = [1]}\n")
    return root


def test_requests_whose_cache_lookup_straddles_a_swap_run_on_the_new_version(
    repository, tmp_path, chelsea_jpeg
) -> None:
    with running_redis(tmp_path) as redis_server:
        args = ["--model-repository", str(repository), "--model-control", "explicit", "--default-model", "lite"]
        args += ["--response-cache-mb", "4", "--response-cache-redis", redis_server.url]
        args += ["--response-cache-redis-timeout-ms", str(LOOKUP_TIMEOUT_MS)]
        args += ["--request-timeout-s", str(REQUEST_TIMEOUT_S)]
        env = {"VISION_SERVE_ADMIN_API_KEY": ADMIN_KEY}
        with ServerProcess(args, log_path=tmp_path / "server.log", env=env) as server:
            assert httpx.post(f"{server.url}/predict", content=chelsea_jpeg, timeout=60).status_code == 200
            client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=600)
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            with ThreadPoolExecutor(2) as pool:
                # New bytes each: memory misses, so both wait on the stalled Redis.
                unpinned = pool.submit(post, server.url, chelsea_jpeg + b"\x01", "")
                pinned = pool.submit(post, server.url, chelsea_jpeg + b"\x02", "?version=1")
                time.sleep(1.0)  # both are in their lookup
                client.load_model("lite", config=version_config(2), headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert not unpinned.done(), "the lookup must still be waiting when the swap is published"
                os.kill(redis_server.process.pid, signal.SIGCONT)
                answered, refused = unpinned.result(), pinned.result()
    assert answered.status_code == 200, (answered.status_code, answered.text)
    assert answered.json()["model_version"] == "2"
    assert refused.status_code == 404, (refused.status_code, refused.text)
    assert "version 1 is not found" in refused.json()["detail"]


def post(url: str, image: bytes, query: str) -> httpx.Response:
    return httpx.post(f"{url}/predict{query}", content=image, timeout=2 * REQUEST_TIMEOUT_S + 60)
