"""Which tokens each rank reads: windows sharded over the "batch" ranks, each window over the cp ranks.

Windows. genolong.data.WindowSampler draws window k of a run from its own generator seeded with
(seed, k), so any rank can draw any window. Step s of a run with `batch` sequences per step uses
windows s*batch ... s*batch + batch - 1 *whatever the layout*: batch rank r of R (R = dp x ep)
takes every R-th of them (the sampler's rank / world_size interleaving), b = batch / R per rank.
One process with the whole batch, or dp=2, or dp=2 x ep=2, trains on the same windows per step.
The sampler state a checkpoint keeps is therefore the layout-free one of a single process
(rank 0 of 1, windows drawn = steps x batch), the same as a one-process run's: a run resumes at
any layout whose data-parallel size divides its batch (`load_sampler_state`).

Tokens of one window. The window of seq_len + 1 bases becomes inputs (the first seq_len) and
targets (the last seq_len, shifted by one) *before* any sharding, so every target is the token
after its input even at a shard boundary; then inputs, targets and the valid mask (target not N)
are cut into cp contiguous shards of seq_len / cp tokens, cp rank i holding tokens
[i * seq_len / cp, (i + 1) * seq_len / cp) (`genolong.parallel.context.shard_batch`, which the
loop calls). The context-parallel wrappers expect exactly this.
"""

from __future__ import annotations

from genolong.errors import GenolongError


def sampler_state(sampler) -> dict:
    """The layout-free state of a (possibly rank-sharded) WindowSampler (module docstring)."""
    state = sampler.state_dict()
    return {**state, "rank": 0, "world_size": 1, "windows_yielded": state["windows_yielded"] * state["world_size"]}


def load_sampler_state(sampler, state: dict) -> None:
    """Continue `sampler` (batch rank r of R; a WindowSampler or a wrapper with its state, such as
    genolong.data.planted.PlantedRepeatSampler) from a layout-free state saved at any layout."""
    drawn = int(state["windows_yielded"])
    mine = sampler.state_dict()
    ranks = int(mine["world_size"])
    if drawn % ranks:
        raise GenolongError(
            f"the checkpoint's data position ({drawn} windows) does not split over {ranks} data-parallel ranks (dp x ep); "
            "resume with a data-parallel size that divides the run's --batch"
        )
    layout_fields = ("rank", "world_size", "windows_yielded")
    # Everything else (data, seed, window options) is checked by the sampler itself.
    sampler.load_state_dict({**{k: v for k, v in state.items() if k not in layout_fields},
                             **{k: mine[k] for k in layout_fields}, "windows_yielded": drawn // ranks})

