"""The fine-tuning tasks fetcher (kept here until ``gradflow tasks fetch`` replaces it)."""
