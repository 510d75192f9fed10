"""`serve` at world size 2: the tiny model sharded at load (--tp 2) behind a real
tritonserver, its Triton model (rank 0) starting and owning the worker rank. The serving
tests of test_triton_server.py run unchanged against it: concurrent streams equal
`k3-trt run` at world 1 (its ``reference`` fixture), cancellation frees blocks and slots,
and stopping the server is bounded and leaves no process, the worker rank included (it
lives in the server's process group)."""
from __future__ import annotations

import pytest
from test_triton_server import (  # noqa: F401  (the fixture and the tests run here, at world 2)
    ENGINE, TINY, leftover_processes, reference, running_server,
    test_cancelling_mid_stream_frees_the_requests_blocks_and_slot, test_concurrent_streams_equal_k3_trt_run_greedy_output,
    test_stop_is_bounded_and_leaves_no_process)

from k3_trtllm.serve.repository import write_model_repository


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("triton-world2")
    write_model_repository(TINY, work / "repo", name="k3", cancellation_check_period_ms=10, tp=2, **ENGINE)
    with running_server(work / "repo", work) as srv:
        assert any("multiprocessing.spawn" in p for p in leftover_processes(srv)), "no worker rank running"
        yield srv
