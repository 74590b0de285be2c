"""Ray Train with ckptturbo checkpoints: a 2-worker DDP TorchTrainer that checkpoints
straight into the run's storage and resumes from its latest checkpoint.

    pip install 'ckptturbo[ray]'
    python examples/ray_train.py                          # storage in a local directory
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python examples/ray_train.py --storage-path s3://bucket/runs --endpoint http://host:9000

Run it twice with the same --name: the second run restores the first one's last
checkpoint (every worker loads it; storage serves each chunk once) and goes on from there.
On a multi-node cluster the same script runs unchanged with ``ray.init(address="auto")``
and an S3 ``--storage-path`` that every node reaches.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch

log = logging.getLogger("ray_train_example")


def train_fn(config: dict) -> None:
    from ray.train.torch import prepare_model
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckptturbo.integrations import ray_train as rt

    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                              torch.nn.Linear(256, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "progress": {"epoch": torch.zeros((), dtype=torch.int64)}}
    start = 0
    if rt.load(state, storage_options=config["storage_options"]) is not None:
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(state["progress"]["epoch"]) + 1
    handle = None
    for epoch in range(start, start + config["epochs"]):
        x = torch.randn(64, 256)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) / 16)
        optim.zero_grad()
        loss.backward()
        optim.step()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "progress": {"epoch": torch.tensor(epoch)}}
        # returns once the state is in host memory; Ray gets the checkpoint once durable
        handle = rt.save(state, {"epoch": epoch, "loss": loss.item()},
                         storage_options=config["storage_options"])
    if handle is not None:
        handle.wait()


def main() -> None:
    import pyarrow.fs
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--storage-path",
                        default=os.path.join(tempfile.gettempdir(), "ray-ckptturbo"))
    parser.add_argument("--endpoint", default=None, help="S3 endpoint URL (e.g. MinIO, SeaweedFS)")
    parser.add_argument("--name", default="example")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    filesystem, path, storage_options = None, args.storage_path, None
    if args.storage_path.startswith("s3://"):
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        storage_options = {"key": key, "secret": secret}
        arrow = {"access_key": key, "secret_key": secret}
        if args.endpoint:
            storage_options["client_kwargs"] = {"endpoint_url": args.endpoint}
            scheme, host = args.endpoint.split("://", 1)
            arrow.update(endpoint_override=host, scheme=scheme)
        filesystem = pyarrow.fs.S3FileSystem(**arrow)
        path = args.storage_path.removeprefix("s3://")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        result = TorchTrainer(
            train_fn,
            train_loop_config={"epochs": args.epochs, "storage_options": storage_options},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name=args.name, storage_path=path, storage_filesystem=filesystem,
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        ).fit()
        log.info("latest checkpoint: %s (metrics %s)", result.checkpoint, result.metrics)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
