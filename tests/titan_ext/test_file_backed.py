"""`titan_ext.file_backed.map_parameters_to_file`: a frozen module's parameters become views of a file mapping.

The values are the very bytes written (a forward is bitwise the in-memory
module's), every parameter's memory maps the file (as the kernel lists the
process's mappings), a tied parameter stays one tensor, and a rewrite goes
to a new file so an older mapping never changes under its reader.
"""

from __future__ import annotations

import torch
from torch import nn

from composer_mesh.titan_ext.file_backed import map_parameters_to_file
from test_trainer_harness import mapped_file


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 16))
        self.head = nn.Linear(16, 64, bias=False)
        # tied: one parameter in both modules
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(tokens)))


def tied_model() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM().to(torch.bfloat16).requires_grad_(False)


def test_parameters_map_the_file_and_compute_bitwise(tmp_path):
    model = tied_model()
    before = {name: p.clone() for name, p in model.named_parameters()}
    tokens = torch.randint(0, 64, (3, 5))
    out_before = model(tokens)
    path = map_parameters_to_file(model, tmp_path / "run" / "ref.safetensors")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ref.safetensors"]
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name]), name
        assert mapped_file(p.data_ptr()) == str(path), name
    # still one tensor for the tied weight (head and `tied`)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(tokens), out_before)


def test_rewrite_leaves_an_older_mapping_unchanged(tmp_path):
    first, second = tied_model(), tied_model()
    path = tmp_path / "ref.safetensors"
    map_parameters_to_file(first, path)
    kept = {name: p.clone() for name, p in first.named_parameters()}
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1)
    map_parameters_to_file(second, path)
    assert all(torch.equal(p, kept[name]) for name, p in first.named_parameters())
    assert not torch.equal(second.mlp[0].weight, first.mlp[0].weight)
