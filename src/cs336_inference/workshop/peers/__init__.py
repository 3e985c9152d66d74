"""The peers the decode benchmarks compare with (Hugging Face's model holding our weights)."""
