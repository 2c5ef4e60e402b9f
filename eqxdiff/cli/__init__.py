"""The console commands, the top floor of the package (it may import every other).

- ``eqxdiff-generate`` (:mod:`eqxdiff.cli.generate`): images or videos from any pipeline eqxdiff serves, with that
  family's options read from its pipeline's ``__call__`` (:mod:`eqxdiff.cli._options`; the command line parsed by
  :mod:`eqxdiff.cli._generate_flags`), ControlNets and a refiner added to it (:mod:`eqxdiff.cli._compose`), LoRA
  files on it (:mod:`eqxdiff.cli._lora`); on one device, a mesh, or several hosts.
- ``eqxdiff-train`` (:mod:`eqxdiff.cli.train`): :func:`eqxdiff.train.run` from named presets.

``scripts/generate.py`` and ``scripts/train.py`` are thin wrappers around the same functions.
"""
