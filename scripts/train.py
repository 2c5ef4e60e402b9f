"""Train or fine-tune a model: ``eqxdiff-train`` (:mod:`eqxdiff.cli.train`), run from a checkout.

    python scripts/train.py digits                                  # the shipped digits model, from scratch
    python scripts/train.py sd15 --data path/to/folder --steps 2000 # fine-tune SD 1.5 on captioned images
    python scripts/train.py digits --help                           # every flag
"""

from eqxdiff.cli.train import cli

if __name__ == "__main__":
    cli()
