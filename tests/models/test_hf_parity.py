"""Our model against transformers' KimiLinearForCausalLM with identical weights (fp32)."""
import pytest
import torch

from models.checkpoint import load_checkpoint
from tests.models.conftest import rel_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TOL = 1e-5


@pytest.mark.parametrize("moe,q_lora_rank,num_layers", [(False, None, 4), (True, None, 4), (True, 16, 8)],
                         ids=["dense", "moe", "moe-qlora-8layers"])
def test_logits_match_transformers_on_a_ragged_batch(hf_checkpoint, moe, q_lora_rank, num_layers):
    path, hf = hf_checkpoint(moe, q_lora_rank, num_layers)
    ours = load_checkpoint(path)
    assert ours.config.mla_use_nope and ours.config.qk_rope_head_dim > 0  # NoPE MLA with a shared k part
    torch.manual_seed(1)
    lengths = [131, 64, 7, 1]  # odd lengths around the 64-token KDA chunk, and a single token
    ids = torch.randint(3, ours.config.vocab_size, (len(lengths), max(lengths)))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        actual = ours(ids, lengths=lengths)
    for b, n in enumerate(lengths):
        err = rel_err(actual[b, :n], expected[b, :n])
        assert err <= TOL, f"sequence {b} (length {n}): relative error {err:.2e}"
        assert actual[b, n:].abs().sum() == 0  # padded positions are left empty


def test_many_experts_take_the_routed_path(tmp_path):
    """16 experts, top-2: the per-expert (routed) MoE path rather than the dense one."""
    from tests.models.hf_reference import hf_config, random_hf_model

    hf = random_hf_model(hf_config(moe=True, num_experts=16, num_experts_per_token=2), seed=2)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.config.num_experts > 4 * ours.config.num_experts_per_token
    ids = torch.randint(3, ours.config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(input_ids=ids).logits) <= TOL


def test_a_wrong_weight_is_detected(hf_checkpoint):
    """The parity check has teeth: perturbing one norm weight of the last MLA layer moves the logits."""
    path, hf = hf_checkpoint(True, None, 4)
    ours = load_checkpoint(path)
    ids = torch.randint(3, ours.config.vocab_size, (1, 20))
    with torch.no_grad():
        ours.model.layers[3].self_attn.kv_a_layernorm.weight.mul_(1.01)
        err = rel_err(ours(ids), hf(input_ids=ids).logits)
    assert err > 1e-4
