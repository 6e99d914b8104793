"""Healing: a short distillation fine-tune of a converted model (accelerate)."""
