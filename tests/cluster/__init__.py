"""Test infrastructure that builds clusters (not tests): see ``netns_slurm``."""
