"""The runs several commands share: the training run."""
