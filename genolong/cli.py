"""The `genolong` command: one typer app, one subcommand per job.

Each subpackage owns its commands in its own `cli.py` (genolong.data.cli, genolong.model.cli,
genolong.train.cli, genolong.eval.cli); this file only mounts them and turns a GenolongError
into one line on stderr with exit code 2 (no traceback for problems the user can fix).
"""

import importlib
import sys

import typer

from genolong.errors import GenolongError

app = typer.Typer(
    name="genolong",
    help="Long-context language modelling of genomes: prepare a FASTA, fine-tune at 512k-1M tokens, "
    "evaluate held-out loss by position.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich's option tables cut long flag names with "..." in a narrow terminal
    # and print a "<bool>" metavar on switches that take no value.
    rich_markup_mode=None,
)

@app.callback()
def _root() -> None:
    """Keeps typer in multi-command mode even when only one command is mounted."""


# (command name, module, function). Order is the order of `genolong --help`.
COMMANDS = [
    ("prepare", "genolong.data.cli", "prepare"),
    ("model-info", "genolong.model.cli", "model_info"),
    ("finetune", "genolong.train.cli", "finetune"),
    ("plan", "genolong.train.cli", "plan"),
    ("export", "genolong.train.export_cli", "export"),
    ("eval-positional", "genolong.eval.cli", "eval_positional"),
    ("eval-recall", "genolong.eval.recall_cli", "eval_recall"),
    ("reach", "genolong.eval.reach", "reach"),
]


def _mount() -> list[str]:
    """Mount every command; return the names whose module is not installed (tests require none)."""
    missing = []
    for name, module, function in COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            missing.append(name)
            continue
        app.command(name)(getattr(mod, function))
    return missing


MISSING_COMMANDS = _mount()


def main() -> None:
    try:
        app()
    except GenolongError as err:
        print(f"genolong: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("genolong: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
