"""engine package: scheduling, pages, sequences, detokenization, the GenerationService."""
