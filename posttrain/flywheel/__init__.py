"""One round of the data flywheel as a chain of cached, resumable stages (``posttrain quickstart``)."""
