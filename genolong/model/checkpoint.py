"""Load and save transformers `glm5_next` checkpoints (config.json + safetensors).

On disk, transformers writes GLM-5.3-Flash in the layout of the original release, which is not
its module layout: routed experts one matrix per expert (`mlp.experts.{e}.gate_proj.weight`),
the KDA short convs as three tensors (`self_attn.q_conv1d.weight`), the forget gate's tensors
directly under `self_attn`, and the mHC tensors as `hc_attn_fn`. genolong's modules use
transformers' *module* names (fused `experts.gate_up_proj`, one `conv1d`, `forget_gate.*`,
`attn_hc.*`), so loading fuses and saving splits; both layouts are accepted on load.

Keys on disk carry a prefix: `model.language_model.` (the multimodal class transformers saves)
or `model.` (flat text-only releases); `lm_head.weight` has none. Vision tensors
(`model.visual.*`) and multi-token-prediction tensors (layers at or past num_hidden_layers,
`mtp.*`, `shared_head`) are not part of genolong's model: they are skipped and counted in the
summary line. FP8 tensors are dequantized (genolong.model.fp8) before they are copied in.

Loading goes one shard at a time through `safe_open` (memory-mapped), one tensor at a time,
straight into the model's parameters: peak host memory is the model plus one tensor. A rank of a
multi-process run reads only the regions it holds (genolong.parallel.sharded_load, the same loop
with other `targets`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from genolong.errors import GenolongError
from genolong.model import fp8, hf_config
from genolong.model.config import ModelConfig
from genolong.model.vocab import dna_tokenizer
from genolong.staging import settle_permissions, staging_dir
from genolong.vocab import DNA_MODEL_VOCAB_SIZE

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' own default shard limit for save_pretrained is 50 GB; 5 GB shards keep a
# partial download or copy cheap to retry and fit any filesystem's single-file limit.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

SAVE_PREFIX = "model.language_model."
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")

_LAYER = re.compile(r"^layers\.(\d+)\.")
_FORGET_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_HC_DISK = re.compile(r"^(layers\.\d+\.)hc_(attn|ffn)_(fn|base|scale)$")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)([qkv])_conv1d\.weight$")
_CONV_INDEX = {"q": 0, "k": 1, "v": 2}


# ----------------------------------------------------------------------------- key layout


@dataclass(frozen=True)
class Placement:
    """Where one disk tensor goes: a model state-dict key and, for fused tensors, which part."""

    target: str
    part: tuple | None = None  # ("gate"|"up"|"down", expert) or ("conv", 0|1|2); None = whole


def placement(rel: str) -> Placement:
    """Model placement of a text-tower key given relative to the text model (no prefix)."""
    if m := _FORGET_GATE.match(rel):
        return Placement(f"model.{m[1]}forget_gate.{m[2]}")
    if m := _HC_DISK.match(rel):
        return Placement(f"model.{m[1]}{m[2]}_hc.{m[3]}")
    if m := _EXPERT.match(rel):
        fused = "gate_up_proj" if m[3] in ("gate", "up") else "down_proj"
        return Placement(f"model.{m[1]}{fused}", (m[3], int(m[2])))
    if m := _CONV.match(rel):
        return Placement(f"model.{m[1]}conv1d.weight", ("conv", _CONV_INDEX[m[2]]))
    return Placement(f"model.{rel}")


def _part_view(param: torch.Tensor, part: tuple | None) -> torch.Tensor:
    """The slice of a fused parameter that a disk tensor fills (it is a view: writes land in place)."""
    if part is None:
        return param
    kind, index = part
    if kind == "conv":
        width = param.shape[0] // 3
        return param[index * width : (index + 1) * width]
    if not 0 <= index < param.shape[0]:
        raise IndexError(index)
    if kind == "down":
        return param[index]
    half = param.shape[1] // 2
    return param[index, :half] if kind == "gate" else param[index, half:]


def _expected_parts(key: str, param: torch.Tensor) -> set:
    if key.endswith("mlp.experts.gate_up_proj"):
        return {(k, e) for e in range(param.shape[0]) for k in ("gate", "up")}
    if key.endswith("mlp.experts.down_proj"):
        return {("down", e) for e in range(param.shape[0])}
    if key.endswith("self_attn.conv1d.weight"):
        return {("conv", i) for i in range(3)}
    return set()


def _disk_name(target: str, part: tuple | None) -> str:
    """The on-disk (transformers-saved) name of a model key or of one part of a fused key."""
    rel = target.removeprefix("model.")
    if part is not None:
        kind, index = part
        if kind == "conv":
            return rel.replace("self_attn.conv1d.weight", f"self_attn.{'qkv'[index]}_conv1d.weight")
        layer_experts = rel.rsplit(".", 1)[0]
        return f"{layer_experts}.{index}.{kind}_proj.weight"
    rel = rel.replace("self_attn.forget_gate.", "self_attn.")
    return re.sub(r"(layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)$", r"\1hc_\2_\3", rel)


def classify(key: str, num_layers: int) -> tuple[str, str]:
    """(kind, key relative to the text model) for a disk key; kind is text, lm_head, vision, mtp or other."""
    if key in LM_HEAD_KEYS:
        return "lm_head", "lm_head.weight"
    if key.startswith(VISION_PREFIXES):
        return "vision", key
    if key.startswith(("mtp.", "model.mtp.")):
        return "mtp", key
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            rel = key[len(prefix) :]
            layer = _LAYER.match(rel)
            if (layer and int(layer[1]) >= num_layers) or ".shared_head." in rel:
                return "mtp", rel
            return "text", rel
    return "other", key


# ----------------------------------------------------------------------------- reading


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise GenolongError(
            f"checkpoint directory {path} does not exist; pass a directory with config.json and *.safetensors"
        )
    file = path / CONFIG_FILE
    if not file.is_file():
        raise GenolongError(
            f"no {CONFIG_FILE} in {path}; a glm5_next checkpoint directory needs config.json next to its safetensors"
        )
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GenolongError(f"cannot parse {file} ({err}); re-download or re-save the checkpoint") from None
    if not isinstance(raw, dict):
        raise GenolongError(f"{file} is not a JSON object; re-download or re-save the checkpoint")
    return raw


def weight_map(path: str | Path) -> dict[str, str]:
    """{tensor key: shard file name} of a checkpoint directory (sharded index or single file)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise GenolongError(
                f"cannot read the weight_map of {index} ({err!r}); re-download the index file"
            ) from None
        missing = sorted({f for f in mapping.values() if not (path / f).is_file()})
        if missing:
            raise GenolongError(
                f"{index} names shard(s) missing from {path}: {', '.join(missing[:3])}; finish the download"
            )
        return dict(mapping)
    single = path / WEIGHTS_FILE
    if single.is_file():
        with safe_open(single, "pt") as f:
            return {k: WEIGHTS_FILE for k in f.keys()}
    raise GenolongError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path}; genolong loads safetensors checkpoints only")


@dataclass
class LoadReport:
    loaded: int = 0
    dequantized: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def summary(self, path: Path) -> str:
        skipped = ", ".join(f"{n} {kind}" for kind, n in sorted(self.skipped.items())) or "nothing"
        return f"loaded {self.loaded} tensors from {path} ({self.dequantized} dequantized from FP8); skipped {skipped}"


def _few(keys, n: int = 5) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


class WholeTargets:
    """Where a single-process load writes: the model's own (whole) tensors.

    `full` maps every state-dict key to a tensor of its whole shape (shapes, coverage checks);
    `pieces(target, part, disk_shape)` lists (region of the disk tensor or None for all of it,
    destination view) to copy. genolong.parallel.sharded_load gives the same interface for a
    rank that holds only parts of each tensor (tp / ep parts, FSDP chunks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.full = dict(model.state_dict(keep_vars=True))

    def pieces(self, target: str, part: tuple | None, disk_shape: tuple) -> list[tuple[tuple | None, torch.Tensor]]:
        return [(None, _part_view(self.full[target], part))]


def load_weights(model: torch.nn.Module, path: str | Path, raw_config: dict, targets=None) -> LoadReport:
    """Copy a checkpoint's text tower into `model` (in place), checking names, coverage and shapes.

    targets: WholeTargets(model) by default; a sharded one reads only this rank's regions
    (safe_open's get_slice: nothing else of the file is read)."""
    path = Path(path)
    num_layers = model.config.num_layers
    block = fp8.block_size_from_config(raw_config) or fp8.DEFAULT_BLOCK
    targets = targets if targets is not None else WholeTargets(model)
    params = targets.full
    wmap = weight_map(path)
    report = LoadReport()
    filled: dict[str, set] = defaultdict(set)
    unexpected: list[str] = []

    by_shard: dict[str, list[str]] = defaultdict(list)
    for key, shard in wmap.items():
        by_shard[shard].append(key)

    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def handle(shard: str):
            # Scales normally sit in their weight's shard; when not, that shard is opened too
            # (memory-mapped, nothing is read until a tensor is asked for).
            if shard not in handles:
                handles[shard] = stack.enter_context(safe_open(path / shard, "pt", device="cpu"))
            return handles[shard]

        for shard in sorted(by_shard):
            f = handle(shard)
            for key in sorted(by_shard[shard]):
                kind, rel = classify(key, num_layers)
                if kind in ("vision", "mtp"):
                    report.skipped[kind] += 1
                    continue
                if fp8.is_scale_key(key):
                    if key.removesuffix(fp8.SCALE_SUFFIX) not in wmap:
                        unexpected.append(key)
                    continue  # consumed with its weight
                if fp8.is_activation_scale_key(key):
                    report.skipped["fp8 activation scales"] += 1
                    continue
                if kind == "other":
                    unexpected.append(key)
                    continue
                where = Placement("lm_head.weight") if kind == "lm_head" else placement(rel)
                param = params.get(where.target)
                disk = f.get_slice(key)
                disk_shape = tuple(disk.get_shape())
                if param is None:
                    if 0 in disk_shape:
                        # A zero-width module (transformers' shared expert at n_shared_experts = 0),
                        # which genolong does not build: nothing to load.
                        report.skipped["empty tensors"] += 1
                    else:
                        unexpected.append(key)
                    continue
                try:
                    expected = tuple(_part_view(param, where.part).shape)
                except IndexError:
                    unexpected.append(key)
                    continue
                skey = fp8.scale_key(key)
                # A scale next to a non-FP8 tensor is refused by dequantize: applying it or
                # ignoring it would both be a guess about what the file means.
                quantized = _dtype_of(disk) in fp8.FP8_DTYPES or skey in wmap
                if quantized and skey not in wmap:
                    raise GenolongError(f"checkpoint tensor {key} is FP8 but has no {skey}; the checkpoint is incomplete")
                if disk_shape != expected:
                    raise GenolongError(
                        f"checkpoint tensor {key} has shape {disk_shape} but the model built from "
                        f"config.json expects {expected}; config.json and the weights disagree"
                    )
                scale = handle(wmap[skey]).get_slice(skey) if quantized else None
                for region, view in targets.pieces(where.target, where.part, disk_shape):
                    tensor = _read(disk, region, scale, block, key)
                    with torch.no_grad():
                        view.copy_(tensor)
                    del tensor
                report.dequantized += int(quantized)
                filled[where.target].add(where.part if where.part is not None else "whole")
                report.loaded += 1

    if unexpected:
        raise GenolongError(
            f"checkpoint has {len(unexpected)} tensor(s) that the model built from its config.json does not have: "
            f"{_few(unexpected)}; check that config.json belongs to these weights"
        )
    missing = []
    for key, param in params.items():
        got = filled.get(key, set())
        if "whole" in got:
            continue
        need = _expected_parts(key, param)
        if not need:
            missing.append(_disk_name(key, None))
        else:
            missing.extend(_disk_name(key, part) for part in need - got)
    if missing:
        raise GenolongError(
            f"checkpoint lacks {len(missing)} tensor(s) of the model: {_few(missing)}; the checkpoint is "
            "incomplete or belongs to another architecture"
        )
    return report


_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}


def _dtype_of(disk) -> torch.dtype | None:
    """The torch dtype of a safe_open slice when it is one the loader treats specially (FP8), else None."""
    return _SAFETENSORS_DTYPES.get(disk.get_dtype())


def _read(disk, region: tuple | None, scale, block: tuple[int, int], key: str) -> torch.Tensor:
    """`region` ((start, stop) per dim; None: all) of a disk tensor, dequantized when `scale` is
    given: an FP8 region is widened to whole scale tiles on its last two dims, dequantized with
    its part of the scale grid and cropped, so only those tiles are read."""
    shape = tuple(disk.get_shape())
    if region is None:
        region = tuple((0, n) for n in shape)
    if scale is None:
        return disk[tuple(slice(a, b) for a, b in region)]
    scale_shape = tuple(scale.get_shape())
    if len(scale_shape) != len(shape) or len(shape) < 2:
        # Per-tensor (or unusual) scales: the whole tensor, as the single-process load reads it.
        whole = fp8.dequantize(disk[:], scale[:], block, dtype=torch.float32, name=key)
        return whole[tuple(slice(a, b) for a, b in region)]
    tiles = (*(1,) * (len(shape) - 2), *block)
    wide = [(a // t * t, min(-(-b // t) * t, n)) for (a, b), t, n in zip(region, tiles, shape, strict=True)]
    grid = [(a // t, -(-b // t)) for (a, b), t in zip(wide, tiles, strict=True)]
    weight = disk[tuple(slice(a, b) for a, b in wide)]
    scales = scale[tuple(slice(a, b) for a, b in grid)]
    out = fp8.dequantize(weight, scales, block, dtype=torch.float32, name=key)
    return out[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(region, wide, strict=True))]


def _build(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """The model with uninitialized storage where possible (every tensor is overwritten by the load)."""
    from genolong.model.model import GenoLongForCausalLM

    with torch.device("meta"):
        model = GenoLongForCausalLM(config, init=False)
    persistent = set(model.state_dict().keys())
    if any(name not in persistent for name, _ in model.named_buffers()):
        # A non-persistent buffer would stay uninitialized after to_empty: build for real.
        with torch.device(device):
            model = GenoLongForCausalLM(config, init=False)
    else:
        model = model.to_empty(device=device)
    # The model's own dtype policy (router, KDA gate/conv and mHC biases stay fp32, as in the
    # reference); the load then casts each checkpoint tensor to its parameter's dtype.
    return model.to_dtype(dtype)


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """GenoLongForCausalLM with the text tower, final norm and lm_head of a glm5_next checkpoint.

    Vision and MTP weights are skipped, FP8 weights dequantized; missing or unexpected text
    tensors and shape mismatches raise GenolongError. The source config.json is kept on the
    model (`hf_source_config`) so that save_pretrained preserves its non-architecture fields, and
    so is its tokenizer.json (`hf_source_tokenizer`): the base-to-id mapping the weights were
    trained with, which a save must carry on rather than replace.
    """
    path = Path(path)
    raw = read_config(path)
    config = hf_config.from_hf(raw, name=path.name)
    model = _build(config, dtype, device)
    report = load_weights(model, path, raw)
    log.info(report.summary(path))
    model.hf_source_config = raw
    tokenizer = path / "tokenizer.json"
    model.hf_source_tokenizer = tokenizer.read_text(encoding="utf-8") if tokenizer.is_file() else None
    model.eval()
    return model


# ----------------------------------------------------------------------------- writing


def disk_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(disk key, tensor) pairs in transformers' saved layout; fused tensors are split (views)."""
    out = []
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            out.append((key, tensor))
            continue
        parts = sorted(_expected_parts(key, tensor), key=lambda p: (p[1], p[0]))
        if parts:
            for part in parts:
                out.append((SAVE_PREFIX + _disk_name(key, part), _part_view(tensor, part)))
        else:
            out.append((SAVE_PREFIX + _disk_name(key, None), tensor))
    return out


def _dtype_name(model: torch.nn.Module) -> str:
    return str(model.lm_head.weight.dtype).removeprefix("torch.")


def save_pretrained(
    model: torch.nn.Module, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Path:
    """Write `model` as a transformers glm5_next checkpoint directory, atomically.

    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so an interrupted save never leaves a half-written checkpoint under `path`. Above
    `max_shard_bytes` the weights are split into `model-0000i-of-0000n.safetensors` shards with
    a `model.safetensors.index.json`, as transformers does. Tensors keep their dtype.
    """
    path = Path(path)
    tensors = disk_tensors(model)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += nbytes
    total = sum(t.numel() * t.element_size() for _, t in tensors)

    tmp = staging_dir(path)
    try:
        source = getattr(model, "hf_source_config", None)
        config = hf_config.to_hf(model.config, dtype=_dtype_name(model), source=source)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        names = (
            [WEIGHTS_FILE]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        index = {}
        for name, shard in zip(names, shards):
            # safetensors refuses tensors sharing storage (the split views of a fused tensor):
            # each shard gets contiguous copies, one shard at a time.
            copies = {k: t.detach().to("cpu").contiguous().clone() for k, t in shard}
            save_file(copies, tmp / name, metadata={"format": "pt"})
            del copies
            index.update({k: name for k, _ in shard})
        if len(shards) > 1:
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        source_tokenizer = getattr(model, "hf_source_tokenizer", None)
        if source_tokenizer is not None:
            # Loaded from a checkpoint with its own tokenizer: its mapping stays with the weights.
            (tmp / "tokenizer.json").write_text(source_tokenizer, encoding="utf-8")
        elif model.config.vocab_size == DNA_MODEL_VOCAB_SIZE:
            # A DNA-vocabulary model carries its own base-to-id mapping.
            (tmp / "tokenizer.json").write_text(json.dumps(dna_tokenizer()) + "\n", encoding="utf-8")
        settle_permissions(tmp)  # safetensors writes 0600: an exported model is for others to read too
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "ckpt")
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved %d tensors (%.2f GiB) in %d shard(s) to %s", len(tensors), total / 1024**3, len(shards), path)
    return path
