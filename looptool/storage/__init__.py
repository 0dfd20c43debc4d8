"""Files: saving and loading looped models, atomic output directories, resumable checkpoints."""
