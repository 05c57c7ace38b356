"""DNA ids -> a checkpoint's single-character token ids, read from its tokenizer.json."""

import json

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model.vocab import checkpoint_base_ids, dna_to_checkpoint_ids, map_dna_ids
from genolong.vocab import A_ID, C_ID, G_ID, N_ID, T_ID


def _bpe_tokenizer(vocab: dict[str, int], added=()) -> dict:
    return {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": c, "special": True} for c, i in added],
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }


def _write(tmp_path, tok) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))


# Ids deliberately not in A, C, G, T, N order, and multi-character tokens that start with a base.
GLM_LIKE = {"!": 0, "AC": 1, "T": 2, "A": 33, "G": 40, "C": 35, "N": 46, "GA": 900}


def test_maps_bases_to_checkpoint_ids(tmp_path):
    _write(tmp_path, _bpe_tokenizer(GLM_LIKE))
    assert checkpoint_base_ids(tmp_path) == {"A": 33, "C": 35, "G": 40, "T": 2, "N": 46}
    mapping = dna_to_checkpoint_ids(tmp_path, vocab_size=1000)
    assert mapping.tolist() == [33, 35, 40, 2, 46]
    dna = torch.tensor([[A_ID, C_ID, G_ID, T_ID, N_ID, A_ID]], dtype=torch.uint8)
    assert map_dna_ids(dna, mapping).tolist() == [[33, 35, 40, 2, 46, 33]]


def test_unigram_vocab_and_added_tokens(tmp_path):
    pieces = [["<unk>", 0.0], ["A", -1.0], ["C", -1.0], ["G", -1.0], ["T", -1.0]]
    tok = {"added_tokens": [{"id": 77, "content": "N"}], "model": {"type": "Unigram", "vocab": pieces}}
    _write(tmp_path, tok)
    assert dna_to_checkpoint_ids(tmp_path / "tokenizer.json").tolist() == [1, 2, 3, 4, 77]


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(GenolongError, match="no tokenizer.json"):
        checkpoint_base_ids(tmp_path)


def test_missing_base_is_refused_by_name(tmp_path):
    vocab = {k: v for k, v in GLM_LIKE.items() if k != "N"}
    _write(tmp_path, _bpe_tokenizer(vocab))
    with pytest.raises(GenolongError, match="no single-character token for base\\(s\\) N"):
        checkpoint_base_ids(tmp_path)


def test_ids_outside_the_checkpoint_vocab_are_refused(tmp_path):
    _write(tmp_path, _bpe_tokenizer(GLM_LIKE))
    with pytest.raises(GenolongError, match="outside the checkpoint's vocab_size 40"):
        checkpoint_base_ids(tmp_path, vocab_size=40)


def test_corrupt_json_and_non_dna_ids_are_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(GenolongError, match="cannot read"):
        checkpoint_base_ids(tmp_path)
    with pytest.raises(GenolongError, match="DNA id 7"):
        map_dna_ids(torch.tensor([0, 7]), torch.arange(5))


def test_saved_dna_model_carries_a_tokenizer_mapping_bases_to_their_ids(tmp_path):
    """A genolong-trained DNA checkpoint can be fine-tuned again (`--model`) with no extra file."""
    import torch as _torch

    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.model.checkpoint import save_pretrained
    from genolong.model.vocab import dna_to_checkpoint_ids
    from genolong.vocab import DNA_VOCAB

    _torch.manual_seed(0)
    save_pretrained(GenoLongForCausalLM(get_preset("tiny")), tmp_path / "ckpt")
    mapping = dna_to_checkpoint_ids(tmp_path / "ckpt")
    assert mapping.tolist() == [DNA_VOCAB[b] for b in "ACGTN"]
