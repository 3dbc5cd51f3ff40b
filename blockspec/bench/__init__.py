"""`blockspec bench`: prompt sets (datasets), the interleaved decode-only measurement (runner), and the
report, summary table and plot (report)."""
