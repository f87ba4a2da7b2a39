"""The Lightning Trainer recipe of docs/launching.md: run with `python` (the Trainer starts the
second process) or under `launcher -n 2`, the Trainer forms the jacklring group and trains a tiny
model for a few steps. Each rank prints its parameters and
those of the same training done in one process (full batches, plain SGD), the analytic result
that DDP's gradient averaging must reproduce."""
import json
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

import adapter.torch_backend  # noqa: F401  (registers "jacklring")

STEPS, PER_RANK, RANKS, LR = 3, 4, 2, 0.1


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * PER_RANK * RANKS, 3, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3)


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(3, 1)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = fresh_model()

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def single_process() -> list[float]:
    """The same steps in one process. For training the Trainer always gives each rank a
    DistributedSampler with shuffle=True (seed 0, epoch 0); each step's two rank batches together,
    with the mean of the two ranks' mean losses, are one batch of 8 with its mean loss."""
    model = fresh_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataset = data()
    x, y = dataset.tensors
    order = [list(torch.utils.data.DistributedSampler(dataset, num_replicas=RANKS, rank=r, shuffle=True, seed=0))
             for r in range(RANKS)]
    for step in range(STEPS):
        rows = [i for r in range(RANKS) for i in order[r][step * PER_RANK:(step + 1) * PER_RANK]]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def formed_by() -> str:
    """How the default group formed (the Python group's record; behind the C++ Backend too)."""
    from adapter.torch_backend.cpp_backend import python_group
    from adapter.torch_backend.process_group import JacklringProcessGroup

    group = torch.distributed.distributed_c10d._get_default_group()
    python = python_group(group, JacklringProcessGroup)
    return python.rendezvous if python is not None else group.rendezvous


if __name__ == "__main__":
    BACKEND = sys.argv[1] if len(sys.argv) > 1 else "jacklring"  # gloo: the same run for comparison
    trainer = L.Trainer(accelerator="cpu", devices=RANKS, strategy=DDPStrategy(process_group_backend=BACKEND),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Tiny()
    trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=PER_RANK, shuffle=False))
    sys.stdout.write("RESULT " + json.dumps({
        "rank": trainer.global_rank, "size": trainer.world_size, "backend": torch.distributed.get_backend(),
        "steps": trainer.global_step, "formed": formed_by(),
        "params": torch.cat([p.detach().flatten() for p in module.parameters()]).tolist(),
        "single_process": single_process()}) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()
