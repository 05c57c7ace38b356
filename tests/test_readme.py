"""Every genolong command the README and the pipeline scripts show reaches the CLI: the subcommand
exists and so does every --flag on its line (checked against the click command typer builds, in
this process: no subprocess per command)."""

import re
from pathlib import Path

import pytest
import typer

from genolong import cli
from genolong.train.resume_flags import changeable_flags

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted((ROOT / "pipelines").glob("*.sh"))
# `.venv/bin/genolong X`, `python -m genolong X`, `genolong X` in backticks, a pipeline's `$G X`.
COMMAND = re.compile(r"(?:\.venv/bin/genolong|-m genolong|`genolong|\$G)[ \t]+([a-z][a-z-]*)([^`\n|#]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _group():
    return typer.main.get_command(cli.app)


def _flags(command) -> set[str]:
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}


def invocations(text: str):
    """(subcommand, [--flags]) for each genolong command in text, shell continuation lines joined;
    a pipeline's `finetune_or_resume RUN STEPS ARGS` passes ARGS to finetune."""
    text = re.sub(r"\\\n\s*", " ", text)
    for m in COMMAND.finditer(text):
        yield m[1], FLAG.findall(m[2])
    for m in re.finditer(r"^\s*finetune_or_resume\s+(.*)$", text, flags=re.M):
        yield "finetune", FLAG.findall(m[1])


def problems(text: str) -> list[str]:
    group = _group()
    found = []
    for name, flags in invocations(text):
        command = group.commands.get(name)
        if command is None:
            found.append(f"genolong has no command {name!r}")
            continue
        found += [f"genolong {name} has no {flag}" for flag in flags if flag not in _flags(command)]
    return found


def test_the_checker_catches_a_misspelt_flag_and_command():
    assert problems("    .venv/bin/genolong finetune --data d --seq 4k --out r --no-recompte\n") == [
        "genolong finetune has no --no-recompte"
    ]
    assert problems("run `genolong eval-positonal --data d`") == ["genolong has no command 'eval-positonal'"]
    assert problems("$G prepare --fasta f \\\n    --out o --holdot x") == ["genolong prepare has no --holdot"]
    assert problems("  finetune_or_resume RUN 10 --preset tiny --seqq 4k") == ["genolong finetune has no --seqq"]


def test_every_readme_command_reaches_the_cli():
    text = (ROOT / "README.md").read_text()
    assert len(list(invocations(text))) >= 10
    assert problems(text) == []


def test_every_subcommand_is_in_the_readme():
    shown = {name for name, _ in invocations((ROOT / "README.md").read_text())}
    assert set(_group().commands) <= shown


@pytest.mark.parametrize("script", PIPELINES, ids=lambda p: p.name)
def test_every_pipeline_command_reaches_the_cli(script):
    text = script.read_text()
    assert list(invocations(text))
    assert problems(text) == []


def test_the_resume_flags_are_listed_alike_in_the_readme_help_and_errors():
    listed = changeable_flags()
    assert listed in " ".join((ROOT / "README.md").read_text().split())
    resume = next(p for p in _group().commands["finetune"].params if p.name == "resume")
    assert listed in resume.help


def test_readme_has_no_overlong_lines_and_no_paths_outside_the_repository():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert max(len(line) for line in lines) <= 200
    assert not [line for line in lines if "../" in line]
