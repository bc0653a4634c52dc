"""A policy with LoRA adapters pushes its merged weights to generation servers (generation/remote.py,
aligner_ext/adapters.py): the server, which runs a plain model of the base's names, then generates
what the rollout engine generates on the adapted policy, and the policy's base is untouched."""

import copy

import pytest
import torch
from served_engine import serve_in_thread, serving
from test_server_and_remote import TEXTS, engine_on, remote, small_model

from aligner_ext.adapters import merged_state
from aligner_ext.generation.base import SamplingParams
from aligner_ext.models.lora import attach
from aligner_ext.models.settings import LoraConfig

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_a_lora_policy_pushes_merged_weights(tiny_tokenizer, tmp_path, weight_sync):
    tok = tiny_tokenizer
    base = small_model(tok)
    served_model = copy.deepcopy(base)
    policy = copy.deepcopy(base)
    attach(policy, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():  # trained adapters: B away from its zero start
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.add_(torch.randn_like(param) * 0.5)
    frozen = {name: value.clone() for name, value in policy.state_dict().items() if ".lora_" not in name}
    prompts = [tok.encode(text) for text in TEXTS[:4]]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    server = serving(engine_on(served_model, tok), served_model, tok, weights_root=str(tmp_path))
    with serve_in_thread(server) as url:
        engine = remote(policy, tok, [url], weight_sync=weight_sync, weight_sync_dir=str(tmp_path / "sync"),
                        weight_sync_address="127.0.0.1")
        engine.update_weights(policy)
        pushed = engine.generate(prompts, greedy)
    merged = merged_state(policy)
    assert all(torch.equal(param, merged[name]) for name, param in served_model.named_parameters())
    expected = engine_on(policy, tok).generate(prompts, greedy)
    assert [o.token_ids for o in pushed] == [o.token_ids for o in expected]
    assert [o.token_ids for o in pushed] != [o.token_ids for o in engine_on(base, tok).generate(prompts, greedy)]
    assert all(torch.equal(value, policy.state_dict()[name]) for name, value in frozen.items())
