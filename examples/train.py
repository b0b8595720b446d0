"""Train a byte-level GPT with RoundPipe, configured by Hydra: the same job as the ``roundpipe-train`` command.

The configs ship inside the package, in ``lightning_roundpipe/app/conf/`` (``--help`` lists them):

    python examples/train.py                          # the default: ~3 min on 2 CPU cores
    python examples/train.py experiment=quick         # ~30 s
    python examples/train.py -m strategy.num_microbatches=2,4 strategy.num_stages=auto,6
"""

from lightning_roundpipe.app.train import main

if __name__ == "__main__":
    main()
