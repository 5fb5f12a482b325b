"""Reports, timelines and the viewer (runner/report/)."""
