"""The invocation page: each build and plan recorded in the output base, rendered as one self-contained HTML file."""
