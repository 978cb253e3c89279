"""Issue 60: why gradflow-mini-en-diffusion stayed at the unigram stage, and the recipe of a diffusion member that
learns (the pre-registered factorial of ``figures/diffusion-diagnosis/plan.md``)."""
