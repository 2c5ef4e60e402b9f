"""Model families. Import a family's module for its classes (``eqxdiff.models.unet2d`` ...)."""
