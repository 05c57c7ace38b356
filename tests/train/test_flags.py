"""finetune's and plan's flags declared once (genolong.train.flags) and the option each one sets."""

import ast
import dataclasses
from pathlib import Path

import typer.main

from genolong.cli import app
from genolong.train.flags import ALL, FINETUNE, MEMORY
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.train.plan_cli import OWN, PLAN

# TrainOptions fields no flag sets: fixed by the recipe, or set by the loop and the launcher.
NOT_FLAGS = {"beta1", "beta2", "eps", "split", "reverse_complement", "max_nonfinite", "resume", "tensorboard"}


def _params(name):
    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


def test_the_flags_finetune_and_plan_share_read_alike():
    finetune, plan = _params("finetune"), _params("plan")
    shared = set(finetune) & set(plan)
    assert set(MEMORY) | {"seq", "preset", "dtype", "grad_accum"} <= shared
    for name in shared - set(OWN):
        a, b = finetune[name], plan[name]
        assert (a.opts, a.secondary_opts, a.default, a.help, a.hidden) == (b.opts, b.secondary_opts, b.default, b.help, b.hidden), name


def test_every_flag_is_one_parameter_of_its_command():
    assert list(_params("finetune")) == list(FINETUNE)
    assert list(_params("plan")) == list(PLAN)
    assert len(set(FINETUNE)) == len(FINETUNE) and len(set(PLAN)) == len(PLAN)


def test_every_flag_target_is_an_option_and_every_option_has_a_flag():
    options, memory = {f.name for f in dataclasses.fields(TrainOptions)}, {f.name for f in dataclasses.fields(MemoryOptions)}
    targets = set()
    for name in FINETUNE:
        target = ALL[name].target
        if target is None:
            continue
        where, _, field = target.rpartition(".")
        assert field in (memory if where == "memory" else options), f"--{name} sets {target}, which is not an option"
        targets.add(target)
    # tile_auto comes with tile_tokens from --tile (MemoryOptions.from_flags), as --baseline sets the switches.
    assert options - {"memory"} - targets == NOT_FLAGS
    assert {f"memory.{m}" for m in memory} - targets == {"memory.tile_tokens", "memory.tile_auto"}


def test_the_plan_modules_import_one_way():
    """plan (the estimate) <- plan_suggest (layouts ranked by it) <- preflight (advice proposing a layout)."""
    root = Path(__file__).resolve().parents[2] / "genolong" / "train"

    def imports(name):
        tree = ast.parse((root / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert not {"genolong.train.plan_suggest", "genolong.train.preflight"} & imports("plan")
    assert "genolong.train.preflight" not in imports("plan_suggest")
    assert "genolong.train.plan_suggest" in imports("preflight")
