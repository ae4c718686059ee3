"""A graft whose inputs are stored in different dtypes: the usual case on real models, whose post and donor
come from the hub in bf16 while graftlab's SFT may save the tuned donor in fp32. Each input is read in its
own dtype and widened to fp32, and the result is stored in the post model's dtype."""

from pathlib import Path

import pytest
import torch
from conftest import build_pico_model
from safetensors.torch import load_file

from graftlab.graft import graft


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize(
    ("donor_dtype", "tuned_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)]
)
def test_inputs_in_other_dtypes_are_widened_before_the_arithmetic(tmp_path, donor_dtype, tuned_dtype):
    post = build_pico_model(tmp_path / "post", seed=1, dtype=torch.bfloat16)
    donor = build_pico_model(tmp_path / "donor", seed=2, dtype=donor_dtype)
    tuned = build_pico_model(tmp_path / "tuned", seed=3, dtype=tuned_dtype, base=donor, noise=0.01)
    graft(post, donor, tuned, 0.5, tmp_path / "out")
    p, d, t, out = (weights(m) for m in (post, donor, tuned, tmp_path / "out"))
    for name, result in out.items():
        want = (p[name].float() + 0.5 * (t[name].float() - d[name].float())).to(torch.bfloat16)
        assert result.dtype == torch.bfloat16, name
        assert torch.equal(result.view(torch.int16), want.view(torch.int16)), name
