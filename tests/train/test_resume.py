"""`--resume` repeats an uninterrupted run's losses exactly on CPU, from a preset or a checkpoint."""

import json
import shutil

import pytest
import torch

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained
from genolong.train import checkpoint as ck
from genolong.train import loop
from genolong.train.metrics import read_jsonl
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")


def _losses(records):
    return [r["loss"] for r in records]


def test_three_plus_three_equals_six_straight(data, tmp_path):
    common = {"steps": 6, "seq_len": 64, "warmup": 2}
    straight = loop.train(tiny_options(data, tmp_path / "a", **common))

    first = loop.train(tiny_options(data, tmp_path / "b", stop_after=3, **common))
    assert [p.name for p in checkpoint_dir.complete_checkpoints(tmp_path / "b")] == ["step_00000003"]
    # Debris of a later save that died before its manifest: resume must not pick it up.
    debris = tmp_path / "b" / ck.CHECKPOINTS / "step_00000005"
    shutil.copytree(tmp_path / "b" / ck.CHECKPOINTS / "step_00000003", debris)
    (debris / checkpoint_dir.COMPLETE).unlink()

    second = loop.train(loop.load_run_options(tmp_path / "b", stop_after=None, progress=False))
    assert [r["step"] for r in second] == [4, 5, 6]
    # Bitwise: same weights, optimizer moments, schedule, windows and RNG after the restart.
    assert _losses(first + second) == _losses(straight)
    assert [r["grad_norm"] for r in first + second] == [r["grad_norm"] for r in straight]
    assert _losses(read_jsonl(tmp_path / "b" / ck.METRICS_FILE)) == _losses(straight)


def test_resume_of_something_that_is_not_a_run(tmp_path):
    with pytest.raises(GenolongError, match="not a genolong run"):
        loop.load_run_options(tmp_path)


def _glm_like_checkpoint(root, vocab_size=16, ids=(7, 9, 8, 11, 10)):
    """A small transformers-format checkpoint with its own vocabulary and a tokenizer.json."""
    torch.manual_seed(1)
    model = GenoLongForCausalLM(get_preset("tiny", vocab_size=vocab_size))
    path = save_pretrained(model, root / "ckpt")
    vocab = {f"tok{i}": i for i in range(vocab_size)}
    vocab.update(dict(zip("ACGTN", ids)))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    return path


def test_start_from_a_checkpoint_maps_dna_ids_and_resumes_exactly(data, tmp_path):
    ckpt = _glm_like_checkpoint(tmp_path)
    common = {"steps": 3, "seq_len": 64, "preset": None, "model_path": str(ckpt)}
    straight = loop.train(tiny_options(data, tmp_path / "a", **common))
    first = loop.train(tiny_options(data, tmp_path / "b", stop_after=1, **common))
    second = loop.train(loop.load_run_options(tmp_path / "b", stop_after=None))
    assert _losses(first + second) == _losses(straight)

    saved = ck.latest(tmp_path / "b")
    assert checkpoint_dir.load_trainer_state(saved)["dna_token_ids"] == [7, 9, 8, 11, 10]
    # The saved model directory is itself a fine-tuning checkpoint (config + weights + tokenizer).
    assert (saved / ck.MODEL_DIR / "tokenizer.json").is_file()
    # Training moved exactly the rows of the mapped tokens in the embedding (others get no gradient).
    from genolong.model import from_pretrained

    before = from_pretrained(ckpt, dtype=torch.float32).model.embed_tokens.weight
    after = from_pretrained(saved / ck.MODEL_DIR, dtype=torch.float32).model.embed_tokens.weight
    moved = sorted(i for i in range(16) if not torch.equal(before[i], after[i]))
    assert set(moved) <= {7, 8, 9, 10, 11} and len(moved) >= 4


def test_a_checkpoint_that_does_not_match_is_refused(data, tmp_path):
    ckpt = _glm_like_checkpoint(tmp_path, ids=(7, 9, 8, 11, 10))
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    del tok["model"]["vocab"]["N"]
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(GenolongError, match="no single-character token for base"):
        loop.train(tiny_options(data, tmp_path / "r", steps=1, seq_len=64, preset=None, model_path=str(ckpt)))
    with pytest.raises(GenolongError, match="does not exist|no config.json"):
        loop.train(tiny_options(data, tmp_path / "r2", steps=1, seq_len=64, preset=None, model_path=str(tmp_path / "nope")))


def test_bf16_params_with_fp32_masters_resume_exactly(data, tmp_path):
    """The GPU precision (bf16 parameters, fp32 master weights and moments), run on CPU."""
    common = {"steps": 4, "seq_len": 64, "dtype": "bfloat16"}
    straight = loop.train(tiny_options(data, tmp_path / "a", **common))
    first = loop.train(tiny_options(data, tmp_path / "b", stop_after=2, **common))
    state = ck.load_optimizer_state(ck.latest(tmp_path / "b"))
    assert state["master.lm_head.weight"].dtype == torch.float32
    assert state["exp_avg.lm_head.weight"].dtype == torch.float32
    second = loop.train(loop.load_run_options(tmp_path / "b", stop_after=None))
    assert _losses(first + second) == _losses(straight)


def test_more_steps_on_resume_are_kept_and_re_derive_the_schedule(data, tmp_path, capsys):
    from genolong.train.optim import lr_at

    run = tmp_path / "b"
    loop.train(tiny_options(data, run, steps=4, seq_len=64, warmup=1, stop_after=2))
    options = loop.load_run_options(run, stop_after=1, progress=False)
    options.steps = 6
    records = loop.train(options)
    # Step 3 of a 6-step run, not of the 4-step run the checkpoint came from.
    assert records[0]["lr"] == lr_at(2, options.lr, 1, 6, options.min_lr_ratio) != lr_at(2, options.lr, 1, 4, options.min_lr_ratio)
    err = capsys.readouterr().err
    assert "--steps 6 (the run had 4), from step 2 on" in err and "schedule is re-derived for 6 steps" in err
    assert json.loads((run / ck.OPTIONS_FILE).read_text())["steps"] == 6
    assert loop.load_run_options(run).steps == 6  # the next resume keeps the new length

    fewer = loop.load_run_options(run, progress=False)
    fewer.steps = 2
    with pytest.raises(GenolongError, match=r"--steps 2 is below the step the run has reached \(3\); give --steps 3 or more"):
        loop.train(fewer)


def test_resuming_a_finished_run_says_so(data, tmp_path, capsys):
    run = tmp_path / "done"
    loop.train(tiny_options(data, run, steps=1, seq_len=64))
    assert loop.train(loop.load_run_options(run, stop_after=None, progress=False)) == []
    assert "has finished all 1 steps; nothing to do" in capsys.readouterr().err
