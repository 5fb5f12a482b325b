"""The run folder: the store, record formats, exports, full disks (runner/runfolder/)."""
