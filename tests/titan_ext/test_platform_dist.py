"""Two gloo processes: process-group setup, the set_timeout shim, FSDP2 with summed gradients,
and HF checkpoints loaded into / saved from an FSDP-sharded model."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from composer_mesh.titan_ext.platform import detect_platform, install_torch_shims

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + rank))


def _sharded(force_sum: bool, platform):
    """FSDP2 as TorchTitan configures it: no gradient division (sum over ranks)."""
    from torch.distributed.fsdp import fully_shard

    from composer_mesh.titan_ext.platform import configure_fsdp_comms

    model = _model()
    for module in (model[0], model[2], model):
        fully_shard(module)
        module.set_gradient_divide_factor(1.0)
    configured = configure_fsdp_comms(model, platform) if force_sum else 0
    return model, configured


def _sharded_checkpoint_round_trip(platform, hf_dir: str, out_dir: str) -> tuple[float, bool]:
    """Load an HF checkpoint into an FSDP-sharded tiny MoE, compare logits, save it back gathered."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.titan_ext.attention import attention_masks
    from composer_mesh.titan_ext.build import build_model
    from composer_mesh.titan_ext.hf.read import load_hf_into_titan
    from composer_mesh.titan_ext.hf.write import save_hf_weights
    from composer_mesh.titan_ext.models import init_model, resolve_model

    cfg = ModelConfig(flavour="tiny_moe", device="cpu", seed=5)
    resolved = resolve_model(cfg, platform)
    with torch.device("meta"):
        sharded = resolved.spec.model.build()
    for layer in sharded.layers.values():
        fully_shard(layer)
    fully_shard(sharded)
    init_model(sharded, "cpu", cfg.seed)
    load_hf_into_titan(sharded, hf_dir)
    whole = build_model(ModelConfig(flavour="tiny_moe", device="cpu", hf_path=hf_dir), platform=platform)
    tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None]
    with torch.no_grad():
        a = sharded(tokens, positions, attention_masks(sharded, positions))
        b = whole(tokens, positions, attention_masks(whole, positions))
    saved = save_hf_weights(sharded, Path(out_dir) / "saved", resolved.hf_config)
    torch.distributed.barrier()
    original, written = load_file(Path(hf_dir) / "model.safetensors"), load_file(saved / "model.safetensors")
    same = original.keys() == written.keys() and all(torch.equal(original[k], written[k]) for k in original)
    return (a - b).abs().max().item(), same


def _barrier_after_failed_collective() -> None:
    """Gloo's barrier first waits on every collective its process group still lists as in flight.
    The failed reduce-scatter is unlisted by gloo's worker thread only after its error reached the
    caller, so a barrier issued at once can re-raise that error (a race seen on a loaded 2-core box)
    before it reaches the wire; the peer is still waiting, so retry until the list is clear."""
    import torch.distributed as dist

    for _ in range(100):
        try:
            dist.barrier()
            return
        except RuntimeError as e:
            if "PREMUL_SUM" not in str(e):
                raise
            time.sleep(0.01)
    raise RuntimeError("gloo kept re-raising the failed reduce-scatter at the barrier")


def _worker(rank: int, port: int, out_dir: str, hf_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from composer_mesh.titan_ext.platform import init_process_group

    report = Path(out_dir) / f"rank{rank}.txt"
    try:
        platform = detect_platform("cpu")
        device = init_process_group(platform, timeout=datetime.timedelta(seconds=240))
        assert device == torch.device("cpu") and dist.get_backend() == "gloo" and dist.get_world_size() == WORLD
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        dist.set_timeout(datetime.timedelta(seconds=30))  # the shim TorchTitan's set_pg_timeouts calls
        dist.barrier()

        # Without force-sum, gloo cannot reduce-scatter with FSDP's PREMUL_SUM.
        plain, _ = _sharded(force_sum=False, platform=platform)
        try:
            plain(_batch(rank)).square().sum().backward()
            premul = "ran"
        except RuntimeError as e:
            premul = "PREMUL_SUM" if "PREMUL_SUM" in str(e) else f"other: {e}"
        _barrier_after_failed_collective()

        model, configured = _sharded(force_sum=True, platform=platform)
        model(_batch(rank)).square().sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]

        # Reference: one process, full model, loss summed over both ranks' batches.
        reference = _model()
        sum(reference(_batch(r)).square().sum() for r in range(WORLD)).backward()
        max_err = max((g - p.grad).abs().max().item() for g, p in zip(grads, reference.parameters()))
        logit_err, same = _sharded_checkpoint_round_trip(platform, hf_dir, out_dir)
        report.write_text(
            f"configured={configured} premul={premul} logits={logit_err:.3e} saved_same={same} max_err={max_err:.3e}\n"
        )
        dist.destroy_process_group()
    except BaseException:
        report.write_text("error\n" + traceback.format_exc())
        raise


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_gloo_ranks(tmp_path, tiny_assets, free_port):
    for attempt in range(2):  # a second try only if another process grabbed the port first
        args = (free_port(), str(tmp_path), str(tiny_assets.moe_dir))
        try:
            mp.start_processes(_worker, args=args, nprocs=WORLD, start_method="spawn")
            break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            reports = {r: tmp_path / f"rank{r}.txt" for r in range(WORLD)}
            details = "\n".join(f"rank {r}: {p.read_text() if p.exists() else '(no report)'}" for r, p in reports.items())
            if attempt == 0 and "address already in use" in f"{e}{details}".lower():
                continue
            pytest.fail(f"{e}\n{details}")
    for rank in range(WORLD):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith("configured=3 premul=PREMUL_SUM logits=0.000e+00 saved_same=True "), text
        assert float(text.split("max_err=")[1]) < 1e-5, text


def test_shims_and_platform_selection():
    install_torch_shims()
    import torch.distributed as dist

    assert callable(dist.set_timeout)
    cpu = detect_platform("cpu")
    assert (cpu.device_type, cpu.backend, cpu.attention, cpu.exact_experts) == ("cpu", "gloo", "sdpa", True)
    assert cpu.needs_force_sum_reduction
    if not torch.cuda.is_available():
        assert detect_platform("auto") == cpu
        with pytest.raises(RuntimeError, match="no CUDA device"):
            detect_platform("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        detect_platform("tpu")


def test_master_port_is_free_below_the_ephemeral_range_and_not_seeded():
    """A store's port must be one the kernel never hands an outgoing connection, and bindable now;
    two pickers with the same global seed must not agree on it (tests and jobs fix seeds)."""
    import random
    import socket

    from composer_mesh.titan_ext.rendezvous import master_port

    low, _ = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = []
    for _ in range(2):
        random.seed(0)
        torch.manual_seed(0)
        ports.append(master_port("127.0.0.1"))
    assert ports[0] != ports[1], ports
    for port in ports:
        assert max(1024, low - 10000) <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
