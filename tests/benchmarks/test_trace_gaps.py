"""The profile's gap analysis (benchmarks/trace_gaps.py) on a hand-built trace whose gaps and causes
are known: one host sync, one wait on another stream, one host-bound gap, one gap too small to count."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr}}


def _host(name, ts, dur, corr=None):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 99, "tid": 1, "ts": ts, "dur": dur,
            "args": {} if corr is None else {"correlation": corr}}


def _trace():
    return [
        _host("cudaLaunchKernel", 0, 2, 1), _kernel("A", 10, 90, 1),  # A: 10-100
        _host("cudaStreamSynchronize", 50, 51),  # the host waits for A, returns at 101
        _host("cudaLaunchKernel", 150, 3, 2), _kernel("B", 155, 45, 2),  # gap 100-155: host sync
        _host("cudaLaunchKernel", 160, 3, 3), _kernel("C", 300, 20, 3),  # launched early; gap 200-300
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 13, "ts": 190, "dur": 105,
         "args": {"stream": 13, "correlation": 9}},  # the copy C waited for: busy 200-295 of the gap
        _host("cudaLaunchKernel", 400, 3, 4), _kernel("D", 405, 10, 4),  # gap 320-405: host-bound
        _host("cudaLaunchKernel", 410, 1, 5), _kernel("E", 417, 10, 5),  # 2 us gap: below the threshold
        _host("cudaStreamSynchronize", 700, 30),  # a sync while the GPU is idle after the window: no gap
    ]


def test_gaps_are_found_and_their_causes_told_apart():
    from trace_gaps import analyse

    s = analyse(_trace(), min_gap_us=5.0)
    assert s["compute_stream"] == [0, 7]
    assert s["compute_busy_ms"] * 1e3 == 90 + 45 + 20 + 10 + 10
    assert abs(s["compute_window_ms"] * 1e3 - (427 - 10)) < 1e-9
    assert abs(s["compute_idle_ms"] * 1e3 - (427 - 10 - 175)) < 1e-9
    causes = s["gaps_by_cause"]
    assert set(causes) == {"host sync: cudaStreamSynchronize", "stream wait", "host-bound"}
    assert causes["host sync: cudaStreamSynchronize"]["count"] == 1
    assert abs(causes["host sync: cudaStreamSynchronize"]["ms"] * 1e3 - 55) < 1e-9
    assert abs(causes["stream wait"]["ms"] * 1e3 - 100) < 1e-9
    assert abs(causes["stream wait"]["other_streams_busy_ms"] * 1e3 - 95) < 1e-9
    assert abs(causes["host-bound"]["ms"] * 1e3 - 85) < 1e-9
    assert [g["ms"] * 1e3 for g in s["largest_gaps"]] == [100, 85, 55]
    assert (s["largest_gaps"][0]["after"], s["largest_gaps"][0]["before"]) == ("B", "C")
    assert sum(v["count"] for v in s["gaps_by_size"].values()) == 3  # the 2 us gap is not counted
    assert s["gaps_by_size"]["<= 100 us"]["count"] == 3


def test_a_trace_without_host_calls_says_so_and_one_without_gpu_events_is_an_error():
    from trace_gaps import analyse, report

    s = analyse([e for e in _trace() if e["cat"] != "cuda_runtime"])
    assert set(s["gaps_by_cause"]) == {"unknown (no host runtime calls in the trace)"}
    assert "idle" in report(s)
    assert analyse([_host("cudaLaunchKernel", 0, 1, 1)]) == {"error": "no GPU events in the trace"}


def test_the_sync_census_counts_synchronising_calls_by_our_call_site():
    import warnings

    from sync_census import census

    modes = []

    def step():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # what torch's sync debug mode says
        warnings.warn("something else")  # not a sync: not counted

    result = census(step, set_mode=modes.append)
    assert modes == ["warn", "default"]  # the mode is switched back after the step
    assert result["syncs"] == 3
    (where, n), = result["sites"].items()
    assert n == 3 and where.startswith("test_trace_gaps.py:") and where.endswith(" step")  # the innermost frame


def test_launch_latency_another_threads_sync_and_nccl_streams_are_not_misread():
    from trace_gaps import analyse

    events = [
        _host("cudaLaunchKernel", 0, 2, 1), _kernel("A", 10, 90, 1),  # A: 10-100
        _host("cudaLaunchKernel", 97, 2, 2), _kernel("B", 120, 10, 2),  # launched 1 us before A ended: host-bound
        {**_host("cudaStreamSynchronize", 100, 101), "tid": 2},  # another thread's sync, ending in the 2nd gap: not its cause
        _host("cudaLaunchKernel", 200, 2, 3), _kernel("C", 210, 10, 3),  # gap 130-210 on the launching thread: host-bound
        _kernel("ncclDevKernel_AllReduce", 0, 1000, 9, stream=21),  # spins the whole time on its own stream
    ]
    s = analyse(events)
    assert s["compute_stream"] == [0, 7]  # not the NCCL stream with more kernel time
    assert set(s["gaps_by_cause"]) == {"host-bound"}
    assert s["gaps_by_cause"]["host-bound"]["count"] == 2


def test_a_call_site_is_named_by_the_package_not_by_a_directory_called_genolong():
    import traceback
    from pathlib import Path

    import genolong.kernels.moe.grouped as ours
    from sync_census import site

    torch_frame = traceback.FrameSummary("/home/me/genolong/.venv/lib/python3.11/site-packages/torch/functional.py", 10, "bincount")
    our_frame = traceback.FrameSummary(str(Path(ours.__file__)), 70, "experts_grouped")
    assert site([our_frame, torch_frame]) == "genolong/kernels/moe/grouped.py:70 experts_grouped"
    assert site([torch_frame]) == "functional.py:10 bincount"  # nothing of ours: the innermost frame
