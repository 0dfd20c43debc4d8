"""Post-training: rollouts, RL with verifiable rewards, distillation and parameter-group merging."""
