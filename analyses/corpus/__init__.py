"""Where the pretraining text comes from: the small SOTU + Brown corpus (``fetch_corpus``) and the
large one (``large``)."""
