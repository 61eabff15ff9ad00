// Private: the state of a Buffer's split (send now, receive later) forms.
#pragma once

#include "epx/exchange/buffer.h"
#include "exchange/progress.h"

namespace epx {

struct Buffer::Split {
  // The outstanding split dispatch: it writes `result`, which dispatch_recv
  // hands to the caller.
  bool dispatch_outstanding = false;
  PendingOp dispatch;
  DispatchResult result;
  bool combine_outstanding = false;
  PendingOp combine;
};

}  // namespace epx
