// The native module shardsync._C. Each part is registered only when the layer it binds is part
// of this build (python/CMakeLists.txt defines SS_PY_HAVE_<PART>), so the package stays
// importable while layers are added.
#include "common.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  namespace sp = shardsync::py_bind;
  m.doc() = "shardsync native bindings (use the `shardsync` package, not this module)";
  m.attr("__version__") = SHARDSYNC_VERSION;
  sp::RegisterErrors(m);
  sp::RegisterCore(m);
  py::list parts;
#ifdef SS_PY_HAVE_LAYOUT
  sp::RegisterLayout(m);
  parts.append("layout");
#endif
#ifdef SS_PY_HAVE_MODEL
  sp::RegisterModel(m);
  parts.append("model");
#endif
#ifdef SS_PY_HAVE_PLAN
  sp::RegisterPlan(m);
  parts.append("plan");
#endif
#ifdef SS_PY_HAVE_STORE
  sp::RegisterStore(m);
  parts.append("store");
#endif
#ifdef SS_PY_HAVE_SESSION
  sp::RegisterSession(m);
  parts.append("session");
#endif
  m.attr("PARTS") = py::tuple(parts);
}
