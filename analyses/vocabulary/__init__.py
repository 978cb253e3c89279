"""Where new vocabulary rows get their gradient during continued MLM: ``python -m analyses.vocabulary.new_rows``."""
