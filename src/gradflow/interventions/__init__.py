"""Interventions on models: surgery, fine-tuning, continued MLM and the Trainer callback."""
