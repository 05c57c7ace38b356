"""The tp / ep placement table, the parts it cuts, the gradient groups, and the config checks (no processes)."""

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import get_preset
from genolong.model.model import GenoLongForCausalLM
from genolong.parallel.expert import check_expert_parallel
from genolong.parallel.layout import ParallelLayout, parse_layout
from genolong.parallel.tensor import check_tensor_parallel
from genolong.parallel.tensor_plan import Split, assemble, grad_reduce_group, local_part, placement, shard_group, slice_parameters

# Written out by hand from the modules (not derived from the table under test).
TP_ROWS = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.b_proj.weight",
    "self_attn.g_b_proj.weight", "self_attn.forget_gate.f_b_proj.weight", "self_attn.forget_gate.dt_bias",
    "self_attn.forget_gate.A_log", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
}
TP_COLUMNS = {"self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"}
EXPERTS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


def _tail(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else name


def test_every_parameter_of_the_model_has_the_expected_placement():
    with torch.device("meta"):
        model = GenoLongForCausalLM(get_preset("glm53-mini", num_layers=4), init=False)
    seen = set()
    for name, _ in model.named_parameters():
        tail, split = _tail(name), placement(name)
        seen.add(tail)
        if tail in TP_ROWS:
            assert split == Split("tp", 0), name
        elif tail in TP_COLUMNS:
            assert split == Split("tp", 1), name
        elif tail == "self_attn.conv1d.weight":
            assert split == Split("tp", 0, blocks=3), name
        elif tail in EXPERTS:
            assert split == Split("ep", 0), name
        else:
            assert split is None, name  # norms, mHC, latent projections, indexer, router, embedding, lm_head
    assert TP_ROWS | TP_COLUMNS | EXPERTS | {"self_attn.conv1d.weight"} <= seen
    # Prefixed keys (an optimizer's flat state) are placed like their parameter.
    assert placement("exp_avg.model.layers.7.self_attn.kv_b_proj.weight") == Split("tp", 0)
    assert placement("master.model.layers.3.mlp.experts.down_proj") == Split("ep", 0)


def test_parts_and_their_assembly():
    full = torch.arange(24.0).view(6, 4)
    assert torch.equal(local_part(full, Split("tp", 0), 1, 2), full[3:])
    assert torch.equal(local_part(full, Split("tp", 1), 0, 2), full[:, :2])
    # The short conv's channels are [q; k; v]: a rank keeps its heads' channels of each third.
    conv = torch.arange(12.0).view(12, 1, 1)
    part = local_part(conv, Split("tp", 0, blocks=3), 1, 2)
    assert part.flatten().tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    for split, tensor in ((Split("tp", 0), full), (Split("tp", 1), full), (Split("tp", 0, blocks=3), conv)):
        parts = [local_part(tensor, split, r, 2) for r in range(2)]
        assert torch.equal(assemble(parts, split), tensor)
    with pytest.raises(ValueError, match="does not split"):
        local_part(full, Split("tp", 0, blocks=3), 0, 4)


@pytest.mark.parametrize(
    "layout, expected",
    [
        ("", {"q": "grad", "norm": "grad", "head": "grad", "expert": "grad"}),
        ("tp=2", {"q": "grad", "norm": "grad_sp", "head": "grad", "expert": "grad_sp"}),
        ("ep=2", {"q": "grad", "norm": "grad", "head": "grad", "expert": "grad_expert"}),
        ("dp=2,tp=2,ep=2", {"q": "grad", "norm": "grad_sp", "head": "grad", "expert": "grad_expert"}),
    ],
)
def test_gradient_groups(layout, expected):
    names = {
        "q": "model.layers.0.self_attn.q_proj.weight",
        "norm": "model.layers.0.input_layernorm.weight",
        "head": "lm_head.weight",
        "expert": "model.layers.3.mlp.experts.gate_up_proj",
    }
    got = {key: grad_reduce_group(name, parse_layout(layout)) for key, name in names.items()}
    assert got == expected


def test_shard_groups_follow_the_layout():
    layout = ParallelLayout(tp=2)
    assert shard_group("model.layers.0.self_attn.o_proj.weight", layout) == "tp"
    assert shard_group("model.layers.3.mlp.experts.down_proj", layout) is None  # ep=1: whole on every rank
    assert shard_group("model.layers.3.mlp.experts.down_proj", ParallelLayout(ep=2)) == "ep"


def test_slicing_a_meta_model_halves_the_split_parameters_only():
    with torch.device("meta"):
        model = GenoLongForCausalLM(get_preset("tiny"), init=False)
    full = {n: p.shape for n, p in model.named_parameters()}
    sliced = slice_parameters(model, "tp", 1, 2)
    assert {_tail(n) for n in sliced} == TP_ROWS | TP_COLUMNS | {"self_attn.conv1d.weight"}
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.device.type == "meta" and q.weight.shape == (32, 64) and q.out_features == 32
    assert model.model.layers[0].self_attn.conv1d.out_channels == 96
    assert model.model.layers[3].mlp.experts.gate_up_proj.shape == full["model.layers.3.mlp.experts.gate_up_proj"]


@pytest.mark.parametrize(
    "layout, overrides, words",
    [
        ("tp=4", {}, "2 KDA heads do not split evenly"),
        ("tp=2", {"dense_mlp": {"intermediate_size": 127}}, "dense MLP's 127 columns do not split evenly"),
        ("tp=2", {"dsa": {"attention_bias": True}}, "attention_bias is not supported"),
    ],
)
def test_tensor_parallel_refusals(layout, overrides, words):
    with pytest.raises(GenolongError, match=words) as err:
        check_tensor_parallel(get_preset("tiny", **overrides), parse_layout(layout))
    assert "\n" not in str(err.value)


def test_tp_with_cp_is_accepted_and_ulysses_splits_a_tp_ranks_kda_heads():
    from genolong.parallel.context import check_context_parallel
    from genolong.parallel.layout import resolve_kda_mode

    tiny, layout = get_preset("tiny"), parse_layout("tp=2,cp=2")
    check_tensor_parallel(tiny, layout)
    check_context_parallel(tiny, layout)
    # tiny's 2 KDA heads leave one per tp rank: Ulysses cannot split it over cp, "auto" passes state.
    with pytest.raises(GenolongError, match="the 1 KDA heads of a tp rank do not split evenly over 2 ranks") as err:
        check_context_parallel(tiny, layout, kda_mode="ulysses")
    assert "\n" not in str(err.value)
    assert resolve_kda_mode(tiny, 2, "auto", tp=2) == "state" and resolve_kda_mode(tiny, 2, "auto") == "ulysses"
    eight = get_preset("tiny", kda={"num_heads": 8, "head_dim": 8})
    assert [resolve_kda_mode(eight, cp, "auto", tp=2) for cp in (2, 4, 8)] == ["ulysses", "ulysses", "state"]


def test_expert_parallel_refusals():
    with pytest.raises(GenolongError, match="8 routed experts do not split evenly; use an ep that divides 8"):
        check_expert_parallel(get_preset("tiny"), parse_layout("ep=3"))
    with pytest.raises(GenolongError, match="no MoE layer"):
        check_expert_parallel(get_preset("tiny", mlp_types=("dense",) * 4), parse_layout("ep=2"))
    check_expert_parallel(get_preset("tiny"), parse_layout("ep=4"))
    check_tensor_parallel(get_preset("tiny"), parse_layout("tp=2,ep=2,dp=2"))
