"""DNA ids -> a GLM checkpoint's own token ids, for fine-tuning a pretrained checkpoint.

Prepared data stores genolong's DNA ids (genolong.vocab: A=0, C=1, G=2, T=3, N=4). A model
trained from scratch uses them directly. A pretrained GLM checkpoint has its own vocabulary
(154,880 byte-level BPE tokens) in which each base letter is a single-character token; feeding
the checkpoint those ids keeps one token per base (the genome experiment's setting) and reuses
the embeddings the checkpoint already has. The ids are read from the checkpoint's
`tokenizer.json` and never guessed: a wrong id would train silently on the wrong embedding
rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from genolong.errors import GenolongError
from genolong.vocab import DNA_BASES

TOKENIZER_FILE = "tokenizer.json"


def _tokenizer_path(path: str | Path) -> Path:
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def _vocab_of(tok: dict, path: Path) -> dict[str, int]:
    """token string -> id over the model vocabulary and the added tokens of a tokenizer.json."""
    model = tok.get("model")
    if not isinstance(model, dict) or "vocab" not in model:
        raise GenolongError(f"{path} has no model.vocab; expected a Hugging Face tokenizers tokenizer.json")
    vocab = model["vocab"]
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
        table = {str(token): int(i) for token, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [[token, score], ...], id = position
        table = {str(entry[0]): i for i, entry in enumerate(vocab)}
    else:
        raise GenolongError(f"{path}: model.vocab is a {type(vocab).__name__}; expected a dict or a list")
    for added in tok.get("added_tokens", []) or []:
        table.setdefault(str(added["content"]), int(added["id"]))
    return table


def checkpoint_base_ids(path: str | Path, vocab_size: int | None = None) -> dict[str, int]:
    """{base: token id} for A, C, G, T, N from a checkpoint directory's (or a file's) tokenizer.json.

    `vocab_size` (the checkpoint's embedding rows), when given, is checked against every id so
    that a tokenizer from a different model is refused instead of indexing past the embedding.
    """
    file = _tokenizer_path(path)
    if not file.is_file():
        raise GenolongError(
            f"no {TOKENIZER_FILE} at {file}: fine-tuning a GLM checkpoint maps DNA bases to its own token ids; "
            "copy the checkpoint's tokenizer.json next to its config.json"
        )
    try:
        tok = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GenolongError(
            f"cannot read {file} as JSON ({err}); re-download the checkpoint's tokenizer.json"
        ) from None
    table = _vocab_of(tok, file)
    missing = [base for base in DNA_BASES if base not in table]
    if missing:
        raise GenolongError(
            f"{file} has no single-character token for base(s) {', '.join(missing)}; this tokenizer cannot "
            "encode DNA one token per base: use a GLM tokenizer or train from scratch with the DNA vocabulary"
        )
    ids = {base: table[base] for base in DNA_BASES}
    if len(set(ids.values())) != len(ids):
        raise GenolongError(f"{file} maps two bases to the same token id ({ids}); the tokenizer is corrupt")
    if vocab_size is not None:
        too_big = {b: i for b, i in ids.items() if not 0 <= i < vocab_size}
        if too_big:
            raise GenolongError(
                f"{file} gives base ids {too_big} outside the checkpoint's vocab_size {vocab_size}; "
                "the tokenizer.json belongs to another model"
            )
    return ids


def dna_to_checkpoint_ids(path: str | Path, vocab_size: int | None = None) -> torch.Tensor:
    """A LongTensor `m` with `m[dna_id] = checkpoint token id`, so `m[ids]` converts a batch."""
    ids = checkpoint_base_ids(path, vocab_size)
    return torch.tensor([ids[base] for base in DNA_BASES], dtype=torch.long)


def map_dna_ids(dna_ids: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    """Convert genolong DNA ids (any integer dtype, e.g. the uint8 of prepared data) to checkpoint ids."""
    if dna_ids.numel() and int(dna_ids.max()) >= mapping.numel():
        raise GenolongError(
            f"DNA id {int(dna_ids.max())} has no checkpoint token (ids 0-{mapping.numel() - 1} are bases); "
            "the input is not genolong DNA data"
        )
    return mapping.to(dna_ids.device)[dna_ids.long()]


def dna_tokenizer() -> dict:
    """A minimal tokenizer.json for a DNA-vocabulary model: each base maps to its genolong id.

    save_pretrained writes it beside such a model, so that a genolong-trained checkpoint can be
    fine-tuned further (`finetune --model`) or evaluated through the same base-to-id mapping as a
    GLM checkpoint, with no special case.
    """
    return {"version": "1.0", "model": {"type": "WordLevel", "vocab": {b: i for i, b in enumerate(DNA_BASES)}, "unk_token": "N"}}
