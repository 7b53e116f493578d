"""The cluster cost model: one step-time model (:mod:`~gradzip.cluster.schedule`, also the
``sim`` backend's virtual clock) and ``gradzip simulate`` (:mod:`~gradzip.cluster.simulate`),
which predicts data-parallel step times of clusters of any size. Nothing here touches a
network: the byte and α–β formulas come from :mod:`gradzip.comm.cost`."""
