"""What "training resumes exactly" means for the framework adapters' tests: the same weights
and the same optimizer state, tensor for tensor."""
from __future__ import annotations

import torch


def assert_same_model_and_optimizer(model_a: dict, model_b: dict, optim_a: dict,
                                    optim_b: dict) -> None:
    """Equal model state dicts and optimizer state dicts (per-parameter state and groups)."""
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    sa, sb = optim_a["state"], optim_b["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert optim_a["param_groups"] == optim_b["param_groups"]
