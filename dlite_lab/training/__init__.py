"""Training pipeline for DLite drafters: data regeneration, target features, losses, stages."""
