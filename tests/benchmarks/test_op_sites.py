"""benchmarks/op_sites.py: kernels traced to the Python lines that launched them, on a hand-built
trace whose answer is known, and on a real CPU profile of a small autograd step."""

import torch

from benchmarks.op_sites import profile_sites, report, sites


def _x(cat, name, tid, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    main, engine = 1, 2
    return [
        # forward, main thread: genolong/model/mhc.py's expand calls aten::add (sequence number 7), which launches k1
        _x("python_function", "/x/genolong/model/layer.py(40): forward", main, 0, 100),
        _x("python_function", "/x/genolong/model/mhc.py(120): expand", main, 10, 50),
        _x("python_function", "/x/torch/_tensor.py(5): __add__", main, 12, 30),
        _x("cpu_op", "aten::add", main, 15, 20, **{"Sequence number": 7}),
        _x("cuda_runtime", "cudaLaunchKernel", main, 20, 2, correlation=1),
        _x("kernel", "add_kernel_bf16", 0, 30, 40, correlation=1),
        # a second launch from another line of the same file
        _x("python_function", "/x/genolong/model/mhc.py(200): collapse", main, 70, 20),
        _x("cpu_op", "aten::copy_", main, 72, 10),
        _x("cuda_runtime", "cudaLaunchKernel", main, 75, 1, correlation=2),
        _x("kernel", "direct_copy", 0, 80, 5, correlation=2),
        # backward, autograd's thread: AddBackward0 of sequence 7 launches k3; the engine's own add launches k4
        _x("cpu_op", "autograd::engine::evaluate_function: AddBackward0", engine, 200, 30, **{"Sequence number": 7}),
        _x("cpu_op", "aten::mul", engine, 205, 10),
        _x("cuda_runtime", "cudaLaunchKernel", engine, 207, 1, correlation=3),
        _x("kernel", "mul_kernel", 0, 210, 7, correlation=3),
        _x("cpu_op", "aten::add", engine, 240, 5),
        _x("cuda_runtime", "cudaLaunchKernel", engine, 241, 1, correlation=4),
        _x("kernel", "add_kernel_bf16", 0, 250, 3, correlation=4),
    ]


def test_kernels_land_on_the_lines_and_backward_nodes_that_launched_them():
    rows = {(r["kernel"], r["site"]): r for r in sites(_trace())}
    assert rows[("add_kernel_bf16", "model/mhc.py:120 expand < model/layer.py:40 forward")]["ms"] == 0.04
    assert rows[("direct_copy", "model/mhc.py:200 collapse < model/layer.py:40 forward")]["op"] == "aten::copy_"
    assert rows[("mul_kernel", "AddBackward0 of aten::add at model/mhc.py:120 expand < model/layer.py:40 forward")]["op"] == "aten::mul"
    assert rows[("add_kernel_bf16", "autograd engine")]["calls"] == 1
    assert [r["kernel"] for r in sites(_trace(), ops=("aten::copy_",))] == ["direct_copy"]
    assert "model/mhc.py:120 expand" in report(sites(_trace()))


def _model_line(a, w):
    return (a * w).sum()


def test_a_real_cpu_profile_finds_this_files_line(tmp_path):
    a = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    rows = profile_sites(lambda: _model_line(a, w).backward(), tmp_path, frame_filter="test_op_sites.py", ops=("aten::mul",))
    assert (tmp_path / "sites.json").is_file()
    forward = [r for r in rows if "_model_line" in r["site"] and "of" not in r["site"]]
    backward = [r for r in rows if r["site"].startswith("MulBackward0 of aten::mul at")]
    assert forward and backward, rows
