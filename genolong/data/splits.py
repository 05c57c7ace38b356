"""Which records go to which split: whole records by name, `chr22` and `22` taken as one name.

Splitting by whole chromosome (never by interval) keeps held-out bases out of training windows
at any context length.
"""

from genolong.errors import GenolongError

SPLITS = ("train", "validation", "holdout")
_SHOWN = 25


def parse_names(text: str | list[str] | None, split: str) -> list[str]:
    """`'chr1,chr2'` -> ['chr1', 'chr2']."""
    if text is None:
        return []
    items = text if isinstance(text, list) else str(text).split(",")
    names = [n.strip() for n in items if n.strip()]
    if not names:
        raise GenolongError(f"--{split} names no records: give comma-separated record names, e.g. --{split} chr1,chr2")
    return names


def aliases(name: str) -> list[str]:
    """The other spellings of a record name (UCSC `chr22`/`chrM` vs Ensembl/NCBI `22`/`MT`)."""
    if name == "chrM":
        return ["MT", "M"]
    if name in ("MT", "M"):
        return ["chrM"]
    if name.startswith("chr") and len(name) > 3:
        return [name[3:]]
    return ["chr" + name]


def check_requested(requested: dict[str, list[str]]) -> None:
    """Rejects a name asked for twice, in one split or in two."""
    owner: dict[str, str] = {}
    for split, names in requested.items():
        for name in names:
            for spelling in [name, *aliases(name)]:
                if spelling in owner:
                    other = owner[spelling]
                    where = f"twice in --{split}" if other == split else f"in both --{other} and --{split}"
                    raise GenolongError(
                        f"record {name!r} is asked for {where}: splits must not overlap; "
                        "list each record in one split only"
                    )
            owner[name] = split


def candidates(requested: dict[str, list[str]]) -> set[str]:
    """Every record name that could end up in a split."""
    return {spelling for names in requested.values() for name in names for spelling in [name, *aliases(name)]}


def resolve(
    requested: dict[str, list[str]], available: list[str], source: str
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Maps requested names onto the file's names: exact match first, then an alias.

    Returns the splits with the file's names and the (asked, used) pairs that took an alias.
    """
    present = set(available)
    resolved: dict[str, list[str]] = {}
    renamed: list[tuple[str, str]] = []
    missing: list[str] = []
    for split, names in requested.items():
        resolved[split] = []
        for name in names:
            if name in present:
                resolved[split].append(name)
                continue
            alias = next((a for a in aliases(name) if a in present), None)
            if alias is None:
                missing.append(name)
            else:
                resolved[split].append(alias)
                renamed.append((name, alias))
    if missing:
        shown = ", ".join(available[:_SHOWN]) + (
            f", ... ({len(available) - _SHOWN} more)" if len(available) > _SHOWN else ""
        )
        if len(available) == 1:
            # Splits are whole records: one record cannot be both trained on and held out.
            raise GenolongError(
                f"record(s) {', '.join(missing)} not in {source}, which has one record ({available[0]}); splits are whole "
                "records, so a genome needs at least two: add a record to hold out (e.g. another chromosome) to the FASTA"
            )
        raise GenolongError(
            f"record(s) {', '.join(missing)} not in {source}, which has: {shown or 'no records'}; "
            f"choose splits from these names with --train/--holdout/--validation"
        )
    check_requested(resolved)
    return resolved, renamed
