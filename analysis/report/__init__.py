"""The report: figures, report.md, report.html, recommendation.json."""
