"""The parallel layout `--parallel dp=..,fsdp=..,cp=..,tp=..,ep=..`: parsed, then checked before anything is allocated.

Five dimensions, their product is the number of processes:
- dp: data parallel. Replicas see different sequences; gradients are averaged.
- fsdp: sharded data parallel (FSDP2, genolong.parallel.fsdp). Data parallel like dp, but each of
  these ranks keeps only 1/fsdp of every parameter (of its tp / ep part), of its gradient and of
  its optimizer state; a layer's parameters are all-gathered for its forward and backward.
- cp: context parallel. One sequence is split along its length across cp ranks (the 1M path).
- tp: tensor parallel. Attention heads and MLP columns are split across tp ranks, with
  sequence parallelism between the projections (norms and mHC streams on sequence shards).
- ep: expert parallel. Routed experts are split across ep ranks; for everything that is not
  an expert, the ep ranks are more data parallelism (they read different sequences), as in
  Megatron's expert-data-parallel view. So sequences per step are split over dp x fsdp x ep.

`check_layout` rejects every combination that cannot run, naming the rule and the fix (Halo's
lesson: invalid parallel combinations fail at config time, not after an hour of loading).
"""

from __future__ import annotations

from dataclasses import dataclass

from genolong.errors import GenolongError

DIMENSIONS = ("dp", "fsdp", "cp", "tp", "ep")
# How context parallelism splits KDA layers (genolong/parallel/context_kda.py): by passing the
# recurrent state between ranks, or by a Ulysses head split (each rank its heads, whole sequence);
# "auto": Ulysses where the KDA heads divide by cp (the faster where both were measured,
# docs/parallel.md), else state passing.
KDA_MODES = ("auto", "state", "ulysses")
# KDA's chunked kernels work in blocks of 64 tokens; a cp shard boundary inside a block or
# inside an indexer pool would split work that one rank must own.
KDA_CHUNK = 64


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.cp * self.tp * self.ep

    @property
    def data_parallel(self) -> int:
        """How many ranks read different sequences (dp x fsdp x ep)."""
        return self.dp * self.fsdp * self.ep

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def __str__(self) -> str:
        # fsdp only when used: the layouts written into earlier checkpoints read the same.
        return ",".join(f"{name}={getattr(self, name)}" for name in DIMENSIONS if name != "fsdp" or self.fsdp > 1)


def parse_layout(text: str | None) -> ParallelLayout:
    """'cp=2' or 'dp=2,fsdp=2,cp=2,tp=1,ep=1' (any order, missing = 1); None or '' is one process."""
    if text is None or not str(text).strip():
        return ParallelLayout()
    sizes: dict[str, int] = {}
    for part in str(text).split(","):
        part = part.strip()
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in DIMENSIONS:
            raise GenolongError(
                f"--parallel {text!r}: {part!r} is not NAME=SIZE with NAME one of {', '.join(DIMENSIONS)}; "
                "write e.g. --parallel cp=2 or --parallel dp=2,tp=4"
            )
        if name in sizes:
            raise GenolongError(f"--parallel {text!r} gives {name} twice; give each dimension once")
        try:
            size = int(value)
        except ValueError:
            raise GenolongError(f"--parallel {text!r}: {name}={value!r} is not a whole number; e.g. {name}=2") from None
        if size < 1:
            raise GenolongError(f"--parallel {text!r}: {name} must be at least 1, got {size}")
        sizes[name] = size
    return ParallelLayout(**sizes)


def required_multiple(layout: ParallelLayout, kpool: int) -> int:
    """The sequence length must be a multiple of this: each cp shard holds whole KDA chunks and
    whole indexer pools, and each tp rank of a shard an equal part of it (sequence parallelism)."""
    granule = KDA_CHUNK * kpool // _gcd(KDA_CHUNK, kpool)
    return layout.cp * granule * layout.tp


def check_layout(
    layout: ParallelLayout,
    config,
    *,
    seq_len: int,
    batch: int,
    world_size: int | None = None,
    kda_mode: str = "auto",
) -> None:
    """Raise a one-line GenolongError for the first rule `layout` breaks for this model and run.

    config: a genolong.model.config.ModelConfig; world_size: the number of processes started
    (None when only planning); kda_mode: how cp splits KDA layers (KDA_MODES)."""
    if world_size is not None and layout.world_size != world_size:
        raise GenolongError(
            f"--parallel {layout} needs {layout.world_size} processes but {world_size} were started; "
            f"start {layout.world_size} (torchrun --nproc_per_node={layout.world_size} ...) or change --parallel so the sizes multiply to {world_size}"
        )
    if layout.tp > 1:
        for what, heads in (("KDA", config.kda.num_heads), ("DSA", config.dsa.num_heads)):
            if heads % layout.tp:
                raise GenolongError(
                    f"--parallel tp={layout.tp}: the model's {heads} {what} heads do not split evenly over {layout.tp} ranks; "
                    f"use a tp that divides {heads}"
                )
    check_kda_mode(layout, config, kda_mode)
    if layout.ep > 1 and "moe" not in config.mlp_types:
        raise GenolongError(f"--parallel ep={layout.ep}: this model has no MoE layer to split; drop ep")
    if layout.ep > 1:
        experts = config.moe.num_experts
        if experts % layout.ep:
            raise GenolongError(
                f"--parallel ep={layout.ep}: the model's {experts} routed experts do not split evenly over {layout.ep} ranks; "
                f"use an ep that divides {experts}"
            )
    multiple = required_multiple(layout, config.dsa.indexer.kpool)
    if (layout.cp > 1 or layout.tp > 1) and seq_len % multiple:
        lower = seq_len // multiple * multiple
        raise GenolongError(
            f"--seq {seq_len} does not split into {layout.cp} context shard(s) of whole {KDA_CHUNK}-token KDA chunks and "
            f"{config.dsa.indexer.kpool}-token indexer pools{' over ' + str(layout.tp) + ' tp ranks' if layout.tp > 1 else ''}: "
            f"it must be a multiple of {multiple}; use --seq {lower or multiple}"
        )
    if batch % layout.data_parallel:
        raise GenolongError(
            f"--batch {batch} sequences per step do not split over {layout.data_parallel} data-parallel rank(s) (dp x fsdp x ep); "
            f"use a --batch that is a multiple of {layout.data_parallel}"
        )


def check_kda_mode(layout: ParallelLayout, config, kda_mode: str) -> None:
    """The KDA split must be known, and the Ulysses split needs the KDA heads to divide by cp."""
    if kda_mode not in KDA_MODES:
        raise GenolongError(
            f"KDA context-parallel mode {kda_mode!r} is not one of {', '.join(KDA_MODES)}; use 'auto' (the default), 'state' or 'ulysses'"
        )
    # Under tp the Ulysses split cuts each tp rank's heads again.
    heads = config.kda.num_heads // layout.tp
    if kda_mode == "ulysses" and layout.cp > 1 and "kda" in config.layer_types and heads % layout.cp:
        what = f"the model's {heads} KDA heads" if layout.tp == 1 else f"the {heads} KDA heads of a tp rank"
        raise GenolongError(
            f"--parallel cp={layout.cp} with the Ulysses KDA split: {what} do not split evenly "
            f"over {layout.cp} ranks; use a cp that divides {heads}, or the state-passing KDA mode"
        )


def resolve_kda_mode(config, cp: int, kda_mode: str, *, tp: int = 1) -> str:
    """The KDA mode that runs: "auto" is "ulysses" when the KDA heads (of a tp rank) divide by cp, else "state"."""
    if kda_mode != "auto":
        return kda_mode
    return "ulysses" if (config.kda.num_heads // tp) % cp == 0 else "state"


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
