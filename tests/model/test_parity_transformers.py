"""genolong's model against transformers' glm5_next (the reference implementation), on CPU.

A small random Glm5NextTextModel is built with transformers (eager attention, fp32), every
parameter perturbed away from its initial value so that no term can hide behind a zero or a one,
and its state dict is copied into genolong's model by adding the `model.` prefix (the keys are
the same by construction). The sequence is long enough that DSA is truly sparse: T is well
above index_topk + kpool.
"""

import copy

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel  # noqa: E402

from genolong.model import GenoLongForCausalLM, get_preset  # noqa: E402
from genolong.model.config import TO_HF_LAYER_TYPES, TO_HF_MLP_TYPES, ModelConfig  # noqa: E402
from genolong.model.model import keeps_fp32  # noqa: E402


SEQ = 300
SCHEDULES = {
    # The preset's own rule: layer 3 is DSA (full indexer) and the only MoE layer.
    "tiny": {},
    # Two adjacent DSA layers, the second reusing the first's top-k ("shared" indexer); the
    # reference only hands top-k to the immediately following layer, so they must be adjacent.
    "shared-indexer": dict(
        num_layers=6,
        layer_types=["kda", "kda", "kda", "dsa", "dsa", "kda"],
        indexer_types=["full", "full", "full", "full", "shared", "full"],
    ),
}


def hf_text_config(c: ModelConfig) -> Glm5NextTextConfig:
    """The transformers config of a genolong config (written here, independent of genolong's loader)."""
    config = Glm5NextTextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden,
        intermediate_size=c.dense_mlp.intermediate_size,
        moe_intermediate_size=c.moe.expert_dim,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.dsa.num_heads,
        num_key_value_heads=c.dsa.num_heads,
        n_shared_experts=c.moe.num_shared_experts,
        n_routed_experts=c.moe.num_experts,
        routed_scaling_factor=c.moe.routed_scaling_factor,
        kv_lora_rank=c.dsa.kv_lora_rank,
        q_lora_rank=c.dsa.q_lora_rank,
        qk_rope_head_dim=0,
        v_head_dim=c.dsa.v_head_dim,
        qk_nope_head_dim=c.dsa.qk_head_dim,
        n_group=c.moe.n_group,
        topk_group=c.moe.topk_group,
        num_experts_per_tok=c.moe.top_k,
        norm_topk_prob=c.moe.norm_topk_prob,
        rms_norm_eps=c.rms_eps,
        pad_token_id=None,
        mlp_layer_types=[TO_HF_MLP_TYPES[t] for t in c.mlp_types],
        layer_types=[TO_HF_LAYER_TYPES[t] for t in c.layer_types],
        indexer_types=list(c.indexer_types),
        index_topk=c.dsa.indexer.topk,
        index_head_dim=c.dsa.indexer.head_dim,
        index_n_heads=c.dsa.indexer.n_heads,
        index_kpool=c.dsa.indexer.kpool,
        index_kpool_always_select_tail=c.dsa.indexer.always_select_tail,
        swiglu_limit=c.moe.swiglu_limit,
        linear_head_dim=c.kda.head_dim,
        linear_num_heads=c.kda.num_heads,
        linear_conv_kernel_dim=c.kda.conv_kernel,
        linear_lower_bound=c.kda.lower_bound,
        hc_mult=c.mhc.num_streams,
        hc_eps=c.mhc.eps,
        hc_sinkhorn_iters=c.mhc.sinkhorn_iters,
    )
    config._attn_implementation = "eager"
    return config


class Pair:
    """A transformers text model + lm_head and the genolong model holding the same weights."""

    def __init__(self, schedule: str):
        self.config = get_preset("tiny", **SCHEDULES[schedule])
        torch.manual_seed(0)
        self.ref = Glm5NextTextModel(hf_text_config(self.config)).eval()
        self.lm_head = torch.nn.Linear(self.config.hidden, self.config.vocab_size, bias=False)
        with torch.no_grad():
            for name, p in self.ref.named_parameters():
                p.add_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.02))
            for name, b in self.ref.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
        self.model = GenoLongForCausalLM(self.config, init=False)
        state = {f"model.{k}": v for k, v in self.ref.state_dict().items()}
        state["lm_head.weight"] = self.lm_head.weight.detach()
        self.model.load_state_dict(state, strict=True)
        self.ids = torch.randint(0, self.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))

    def ref_logits(self, ref=None, lm_head=None):
        return (lm_head or self.lm_head)((ref or self.ref)(input_ids=self.ids).last_hidden_state)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _capture(layers, store):
    for i, layer in enumerate(layers):
        def hook(module, args, out, i=i):
            store[i] = out[0] if isinstance(out, tuple) else out

        layer.register_forward_hook(hook)


@pytest.fixture(scope="module", params=list(SCHEDULES))
def pair(request):
    return Pair(request.param)


def test_fp32_logprobs_layers_and_selection_match(pair):
    ref_layers, our_layers, ref_idx, our_idx = {}, {}, {}, {}
    _capture(pair.ref.layers, ref_layers)
    _capture(pair.model.model.layers, our_layers)
    for i in pair.config.dsa_layers:
        for module, store in ((pair.ref.layers[i].self_attn, ref_idx), (pair.model.model.layers[i].self_attn, our_idx)):
            if module.indexer is not None:
                module.indexer.register_forward_hook(lambda m, a, out, i=i, store=store: store.__setitem__(i, out))
    with torch.no_grad():
        ref_lp = token_logprobs(pair.ref_logits(), pair.ids)
        our_lp = token_logprobs(pair.model(pair.ids).logits, pair.ids)

    diff = (ref_lp - our_lp).abs().max().item()
    print(f"\nfp32 per-token log-prob max abs diff: {diff:.3e}")
    assert diff <= 1e-4
    assert set(ref_layers) == set(our_layers) == set(range(pair.config.num_layers))
    for i in ref_layers:
        ref_out, our_out = ref_layers[i], our_layers[i]
        rel = ((our_out - ref_out).abs().max() / ref_out.abs().max()).item()
        print(f"layer {i} ({pair.config.layer_types[i]}): max rel diff {rel:.2e}")
        assert rel <= 1e-5, f"layer {i}"

    assert ref_idx and set(ref_idx) == set(our_idx)
    width = pair.config.dsa.indexer.width
    for i in ref_idx:
        assert torch.equal(ref_idx[i].sort(-1).values, our_idx[i].sort(-1).values), f"layer {i} selected other keys"
        keys_per_query = (our_idx[i] >= 0).sum(-1)
        # Truly sparse: late queries see at most `width` keys out of hundreds.
        assert keys_per_query.max() <= width < SEQ // 4
        assert (keys_per_query[:, -1] < SEQ).all()


def test_fp32_gradients_match(pair):
    ref_lp = token_logprobs(pair.ref_logits(), pair.ids)
    ref_lp.mean().backward()
    our_lp = token_logprobs(pair.model(pair.ids).logits, pair.ids)
    our_lp.mean().backward()
    ref_grads = {f"model.{n}": p.grad for n, p in pair.ref.named_parameters()}
    ref_grads["lm_head.weight"] = pair.lm_head.weight.grad
    worst = 0.0
    for name, p in pair.model.named_parameters():
        want = ref_grads[name]
        if want is None:
            assert p.grad is None, f"{name}: transformers gives no gradient here (frozen indexer)"
            continue
        rel = ((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel <= 1e-4, name
    print(f"\nfp32 gradient max rel diff over all parameters: {worst:.2e}")
    pair.model.zero_grad(set_to_none=True)
    pair.ref.zero_grad(set_to_none=True)
    pair.lm_head.zero_grad(set_to_none=True)


def test_bf16_logprob_difference_is_reported_and_small(pair):
    """bf16 vs the fp32 reference, with transformers' own bf16 error for scale."""
    ours = copy.deepcopy(pair.model).to_dtype(torch.bfloat16)
    ref = copy.deepcopy(pair.ref).to(torch.bfloat16)
    for name, t in [*ref.named_parameters(), *ref.named_buffers()]:
        if keeps_fp32(f"model.{name}"):
            t.data = t.data.float()  # what transformers' _keep_in_fp32_modules_strict does on load
    lm_head = copy.deepcopy(pair.lm_head).to(torch.bfloat16)
    with torch.no_grad():
        exact = token_logprobs(pair.ref_logits(), pair.ids)
        ours_lp = token_logprobs(ours(pair.ids).logits, pair.ids)
        ref_lp = token_logprobs(pair.ref_logits(ref, lm_head), pair.ids)
    ours_err = (ours_lp - exact).abs().mean().item()
    ref_err = (ref_lp - exact).abs().mean().item()
    between = (ours_lp - ref_lp).abs().mean().item()
    print(
        f"\nbf16 mean abs log-prob diff: genolong vs fp32 {ours_err:.4f}, transformers bf16 vs fp32 {ref_err:.4f}, "
        f"genolong bf16 vs transformers bf16 {between:.4f}"
    )
    assert ours_err <= 2 * ref_err + 0.01
    assert ours_err <= 0.05
