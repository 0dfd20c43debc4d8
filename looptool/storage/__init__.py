"""Files: the saved looped-model format (writing it, reading and checking it, binding its
tensors), atomic output directories, resumable checkpoints. Storage sees a model only through
its attributes and imports nothing from the runtime; the runtime loads and saves through it."""
