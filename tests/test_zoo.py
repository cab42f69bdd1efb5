"""labkit.zoo: every entry has its published parameter count, the architecture of Hugging Face's (or
diffusers') implementation, and (at toy size) runs for real. Real sizes are only ever built on meta."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from labkit import zoo
from labkit.config import UsageError

PUBLISHED = {
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mixtral-8x7b": 46_702_792_704,
    "flux-dev": 11_901_408_320,
}
# GPT-3's paper gives "175.0B" (https://arxiv.org/abs/2005.14165, Table 2.1): rounded, and no checkpoint
# was released to count. This is computed from the paper's shape, not published.
GPT3_COMPUTED, GPT3_PAPER = 174_604_259_328, 175.0e9
CAUSAL = [name for name in zoo.names() if zoo.get(name).family in ("llama", "mixtral", "gpt")]


def on_meta(build):
    with torch.device("meta"):
        return build()


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def hf_config(spec: zoo.ModelSpec):
    """The Hugging Face config equivalent to a zoo spec."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    if spec.family == "gpt":
        return GPT2Config(n_layer=spec.layers, n_embd=spec.width, n_head=spec.heads, n_positions=spec.context,
                          vocab_size=spec.vocab, bos_token_id=0, eos_token_id=0)
    common = dict(num_hidden_layers=spec.layers, hidden_size=spec.width, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, intermediate_size=spec.ffn, vocab_size=spec.vocab,
                  max_position_embeddings=spec.context, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
                  tie_word_embeddings=spec.tied, bos_token_id=0, eos_token_id=0)
    if spec.family == "mixtral":
        return MixtralConfig(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, **common)
    return LlamaConfig(**common)


def hf_model(spec: zoo.ModelSpec):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(spec))


def flux_diffusers(spec: zoo.ModelSpec):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=spec.in_channels, num_layers=spec.layers, num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads, joint_attention_dim=spec.text_dim,
        pooled_projection_dim=spec.pooled_dim, guidance_embeds=spec.guidance, axes_dims_rope=spec.axes_dims)


# ------------------------------------------------------------------------------------ counts
@pytest.mark.parametrize("name", zoo.names())
def test_closed_form_count_is_the_built_models(name):
    spec = zoo.get(name)
    assert spec.param_count() == numel(on_meta(spec.build))


def test_published_counts():
    assert {name: zoo.get(name).param_count() for name in PUBLISHED} == PUBLISHED


def test_gpt_3s_count_is_computed_from_its_shape_and_rounds_to_the_papers():
    count = zoo.get("gpt-3-175b").param_count()
    assert count == GPT3_COMPUTED and round(count / 1e9) == round(GPT3_PAPER / 1e9)  # 175 B
    assert "computed from the paper's shape" in zoo.__doc__ and f"{GPT3_COMPUTED:,}" in zoo.__doc__


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_lms_are_hugging_faces_architecture(name):
    """Same count, and every parameter's name (mapped) and shape, as transformers' model of the same config."""
    spec = zoo.get(name)
    ours, theirs = on_meta(spec.build), on_meta(lambda: hf_model(spec))
    assert numel(ours) == numel(theirs)
    mapped = zoo.from_hf_state_dict(spec, theirs.state_dict())
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    if spec.family == "llama":  # the same layout: even the raw shape lists agree
        assert sorted(p.shape for p in ours.parameters()) == sorted(p.shape for p in theirs.parameters())


@pytest.mark.parametrize("name", ["flux-dev", "small-flux"])
def test_flux_is_diffusers_flux(name):
    spec = zoo.get(name)
    ours, theirs = on_meta(spec.build), on_meta(lambda: flux_diffusers(spec))
    assert numel(ours) == numel(theirs)
    assert numel(ours.double_blocks[0]) == numel(theirs.transformer_blocks[0])
    assert numel(ours.single_blocks[0]) == numel(theirs.single_transformer_blocks[0])
    assert (len(ours.double_blocks), len(ours.single_blocks)) == (spec.layers, spec.single_layers)


def test_spec_fields():
    spec = zoo.get("llama-3-8b")
    assert (spec.head_dim, spec.kv_heads, spec.context, spec.tied) == (128, 8, 8192, False)
    assert spec.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB a token in bf16
    assert zoo.get("llama-3.1-8b").context == 131072 and zoo.get("llama-3.2-1b").tied
    assert spec.source.startswith("https://huggingface.co/meta-llama/")
    with pytest.raises(ValueError, match="no KV cache"):
        zoo.get("flux-dev").kv_bytes_per_token(2)


# ------------------------------------------------------------------------------------ real runs at toy size
@pytest.mark.parametrize("name", ["small-llama", "small-mixtral", "small-gpt"])
def test_small_causal_lms_train(name):
    torch.manual_seed(0)
    model = zoo.get(name).build()
    idx = torch.randint(256, (2, 32))
    calls = []

    def run_blocks(blocks, x):
        calls.append(blocks)
        for block in blocks:
            x = block(x)
        return x

    logits, loss = model(idx, idx.roll(-1, dims=1), run_blocks=run_blocks)
    assert calls == [model.blocks] and isinstance(calls[0], torch.nn.ModuleList)
    assert logits.shape == (2, 32, 256) and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    with torch.no_grad():
        assert torch.equal(model(idx)[0], logits.detach()) and model(idx)[1] is None


def test_small_flux_runs():
    torch.manual_seed(0)
    spec = zoo.get("small-flux")
    model = spec.build()
    latents = torch.randn(2, 16, spec.in_channels)
    out = model(latents, torch.randn(2, 8, spec.text_dim), torch.randn(2, spec.pooled_dim), torch.rand(2),
                torch.full((2,), 3.5))
    assert out.shape == latents.shape
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_real_sizes_run_on_meta():
    """A forward at real size on meta: shapes only (MoE routing without data is balanced)."""
    with torch.device("meta"):
        for name in ("llama-3.2-1b", "mixtral-8x7b"):
            logits, loss = zoo.get(name).build()(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))
            assert logits.shape == (1, 16, zoo.get(name).vocab) and loss.shape == ()
        out = zoo.get("flux-dev").build()(torch.zeros(1, 64, 64), torch.zeros(1, 8, 4096), torch.zeros(1, 768),
                                          torch.zeros(1), torch.zeros(1))
        assert out.shape == (1, 64, 64)


def gpt_step_peaks(spec: zoo.ModelSpec, seq: int) -> tuple[dict, int]:
    """The per-category peaks of one AdamW training step of ``spec`` at ``seq`` tokens on fake tensors,
    and the bytes of its position table."""
    from labkit import Ledger, fake

    with fake.tensors():
        model = fake.materialize(spec.build)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        idx = torch.zeros(1, seq, dtype=torch.long)
        ledger = Ledger("cpu").track_module(model).track_optimizer(opt)
        with ledger:
            model(idx, idx)[1].backward()
            opt.step()
    timeline = ledger.timeline()
    return {c: max(timeline.device[c]) for c in timeline.categories}, model.pos.weight.nbytes


def test_a_gpt_traces_past_its_context_on_fake_tensors_and_refuses_on_real_ones():
    """Past its learned positions a GPT (fit.py warns, then traces) reads position p from row p mod
    context: every category holds what a GPT whose table had seq rows holds, less those extra rows
    (once as parameters, once as gradients, twice as AdamW's moments)."""
    spec = zoo.get("small-gpt")
    longer = dataclasses.replace(spec, context=2 * spec.context)
    ours, table = gpt_step_peaks(spec, longer.context)
    theirs, longer_table = gpt_step_peaks(longer, longer.context)
    extra = longer_table - table
    assert extra == spec.context * spec.width * 4
    assert ours == {**theirs, "parameters": theirs["parameters"] - extra, "gradients": theirs["gradients"] - extra,
                    "optimizer_state": theirs["optimizer_state"] - 2 * extra}
    with pytest.raises(ValueError, match="longer than small-gpt's context, 128: only a trace on fake tensors"):
        spec.build()(torch.zeros(1, spec.context + 1, dtype=torch.long))
    spec.build()(torch.zeros(1, spec.context, dtype=torch.long))  # up to the context, a real model runs


def test_gpt_3_traces_at_the_default_4k_tokens_past_its_2k_context():
    """GPT-3's published context is 2,048 tokens; fit.py's default --seq is 4,096: a forward on fake
    tensors runs at full size (it was a ValueError after the warning)."""
    from labkit import fake

    spec = zoo.get("gpt-3-175b")
    with fake.tensors():
        model = fake.materialize(spec.build, dtype=torch.bfloat16)
        with torch.no_grad():
            logits = model(torch.zeros(1, 2 * spec.context, dtype=torch.long))[0]
    assert logits.shape == (1, 4096, spec.vocab) and fake.is_fake(logits)


@pytest.mark.parametrize("name", ["small-llama", "small-mixtral"])
def test_same_logits_as_hugging_face(name):
    """Hugging Face's weights loaded into the zoo's model give HF's logits: the architecture is the real one."""
    torch.manual_seed(0)
    spec = zoo.get(name)
    theirs = hf_model(spec).eval()
    ours = spec.build().eval()
    ours.load_state_dict(zoo.from_hf_state_dict(spec, theirs.state_dict()))
    idx = torch.randint(spec.vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(input_ids=idx).logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ Hugging Face configs
def small_llama_config(path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, bos_token_id=0,
                eos_token_id=0).to_json_file(path)
    return path


def test_hf_config_builds_transformers_model(tmp_path):
    path = small_llama_config(tmp_path / "config.json")
    spec = zoo.get(str(path))
    assert (spec.family, spec.layers, spec.width, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == \
        ("hf", 2, 64, 4, 2, 128, 256)
    assert zoo.get(str(tmp_path)).param_count() == spec.param_count() == zoo.get("small-llama").param_count()
    torch.manual_seed(0)
    model = spec.build()
    idx = torch.randint(256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256) and torch.isfinite(loss)
    seen = []

    def run_blocks(blocks, x):
        seen.append(len(blocks))
        for block in blocks:
            x = block(x)
        return x

    logits2, loss2 = model(idx, idx, run_blocks=run_blocks)
    assert seen == [2] and torch.equal(logits, logits2)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2  # the list is back


def test_bad_models_are_one_line_usage_errors(tmp_path):
    from transformers import BertConfig

    BertConfig().to_json_file(tmp_path / "bert.json")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "typeless.json").write_text(json.dumps({"hidden_size": 8}))
    cases = {
        "llama-9": "unknown model 'llama-9'",
        str(tmp_path / "missing" / "config.json"): "no such file",
        str(tmp_path / "bert.json"): "not a decoder-only causal language model",
        str(tmp_path / "broken.json"): "not JSON",
        str(tmp_path / "typeless.json"): "no model_type",
    }
    for arg, message in cases.items():
        with pytest.raises(UsageError) as info:
            zoo.get(arg)
        text = str(info.value)
        assert message in text and "\n" not in text and (arg in text or arg.startswith("llama")), text
    assert "llama-3-8b" in str(pytest.raises(UsageError, zoo.get, "llama-9").value)


# ------------------------------------------------------------------------------------ latent attention (MLA)
def deepseek_hf(spec: zoo.ModelSpec):
    """transformers' DeepseekV2ForCausalLM of the same configuration (RoPE without YaRN: its values only)."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    return AutoModelForCausalLM.from_config(DeepseekV2Config(
        num_hidden_layers=spec.layers, hidden_size=spec.width, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, intermediate_size=spec.ffn, moe_intermediate_size=spec.moe_ffn,
        vocab_size=spec.vocab, max_position_embeddings=spec.context, rms_norm_eps=spec.norm_eps,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"}, tie_word_embeddings=spec.tied,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank or None, qk_rope_head_dim=spec.rope_dim,
        qk_nope_head_dim=spec.head_dim, v_head_dim=spec.v_head_dim, head_dim=spec.rope_dim,
        n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k, n_shared_experts=spec.shared_experts,
        first_k_dense_replace=spec.dense_layers, norm_topk_prob=False, topk_method="greedy",
        bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "small-deepseek"])
def test_deepseek_is_hugging_faces_deepseek_v2(name):
    """DeepSeek-V2-Lite's published configuration (its config.json, the zoo's source) built by transformers
    has the zoo's count, 15,706,484,224 (the model card's "15.7B"), and every parameter's name and shape."""
    spec = zoo.get(name)
    ours, theirs = on_meta(spec.build), on_meta(lambda: deepseek_hf(spec))
    assert spec.param_count() == numel(ours) == numel(theirs)
    mapped = zoo.from_hf_state_dict(spec, theirs.state_dict())
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    if name == "deepseek-v2-lite":
        assert numel(ours) == 15_706_484_224 and round(numel(ours) / 1e8) / 10 == 15.7
        assert spec.source == "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json"


def test_deepseek_gives_hugging_faces_logits_and_caches_its_latent():
    torch.manual_seed(0)
    spec = zoo.get("small-deepseek")
    theirs = deepseek_hf(spec).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # HF starts its router at zero: every weight random, so routing matters
            p.normal_(0, 0.1)
    ours = spec.build().eval()
    ours.load_state_dict(zoo.from_hf_state_dict(spec, theirs.state_dict()))
    idx = torch.randint(spec.vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(input_ids=idx).logits, atol=1e-5, rtol=1e-5)
    lite = zoo.get("deepseek-v2-lite")
    assert lite.kv_bytes_per_token(2) == lite.layers * (lite.kv_lora_rank + lite.rope_dim) * 2  # 31,104 B
