"""Train a Llama-family model with jmem's memory techniques, one flag each.

With no flags: the `small` preset (about 3.2M parameters, byte-level vocab)
from scratch on the standard library's help text, 200 steps, full remat, bf16
compute, Adafactor. It prints the compiler-measured and analytic memory of
one step first, then a progress bar with loss, tokens/s and step time.

    python experiments/train.py
    python experiments/train.py --model tiny --steps 50 --remat minimal --accum 4 --optimizer adam8bit
    python experiments/train.py --ckpt-dir /tmp/run --ckpt-every 50   # Ctrl-C saves; add --resume to continue
    python experiments/train.py --model smollm2-135m --seq 256 --batch 4 --lr 1e-4 --optimizer adamw
    python experiments/train.py --model smollm2-135m --lora-rank 16 --quantize-base nf4 --seq 256 --batch 4 --lr 2e-4 --optimizer adamw

ZeRO-Offload / ZeRO-Infinity: optimizer state (+ f32 master weights) in host memory with the update
on the host, or in files under --offload-dir updated one layer slice at a time; the layer parameters
in host memory, fetched to the device one layer at a time inside the layer scan:

    python experiments/train.py --offload-optimizer host --offload-params host
    python experiments/train.py --offload-optimizer disk --offload-dir /scratch/opt-state --ckpt-dir /tmp/run

On several devices (8 simulated CPU devices here; the same flags on GPUs/TPUs):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/train.py \
        --model tiny --mesh data=2,fsdp=2,tensor=2 --zero 3 --batch 8
    python experiments/train.py --model tiny --pipeline-stages 2 --microbatches 2 --mesh stage=2,data=-1
    python experiments/train.py --model tiny-moe --mesh data=2,expert=4       # MoE: router losses in the log
    # multi-host: the same command on every host, --process-id 0..N-1
    python experiments/train.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 --mesh fsdp=-1 --zero 3

Bad flags (unknown policy or optimizer, --accum not dividing --batch, a
precision string that does not parse, a non-finite or negative --lr, --clip or
--weight-decay, --seq beyond a model file's context, a checkpoint dir of
another model or setup, --resume with no checkpoint or no steps left,
`--zero 4`, a mesh that does not match the device count, an unknown --offload-optimizer or
--offload-params, disk offload without --offload-dir, offload with --zero 3) end
with one line on stderr and exit status 2; nothing is written.
Exit status 130 when SIGINT/SIGTERM stopped the run (after its checkpoint); 1 when a write failed
(a full disk), the loss became NaN or inf (no checkpoint of that state is written; with fp16, when the
loss scale had nothing left to back off), or, in a multi-process run, a step failed (another process
stopped), with one line.
"""

from __future__ import annotations

import os
import sys

import tyro

from jmem.io.checkpoint import CheckpointWriteError
from jmem.memory.disk_offload import OffloadWriteError
from jmem.parallel.distributed import DistributedRunError
from jmem.train import TrainConfig, train
from jmem.train.loop import LogWriteError, TrainingDiverged


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(TrainConfig, args=argv, description=__doc__.split("\n\n")[0])
    try:
        result = train(cfg)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointWriteError, OffloadWriteError, LogWriteError, TrainingDiverged) as e:
        # A full disk, or a NaN loss: the earlier checkpoints are intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the step loop (loading, compiling; the final eval)
        print("interrupted", file=sys.stderr)
        return 130
    except DistributedRunError as e:  # another process stopped: JAX's exit would wait for it, then abort
        print(f"error: {e}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
