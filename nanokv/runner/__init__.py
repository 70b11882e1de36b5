"""Turns ScheduledBatches into tensors, runs the model, samples."""
