"""Mixed-depth training: text data, budget sampling and the trainer."""
