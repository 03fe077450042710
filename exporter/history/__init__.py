"""What finished loads say: their SQLite store (store.py), the histograms of this run
(histograms.py), a restart's forecast (forecast.py), a load's report against the ones before it
(explain.py), the startupProbe window (startupwindow.py) and one target's past loads in one view
(pastloads.py).

"History" is the store of finished loads (`HistoryStore`, `--history.path`, what the `history`
command lists); `PastLoads` is what it says of one target, read once per finished load.
"""
